"""`glmconv parity`: layerwise train-vs-serve parity report with a CI exit code."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from glmconv import api
from glmconv import defaults as D
from glmconv.compare.catalog import NAMES as DEFECT_NAMES
from glmconv.compare.options import check_self_test
from glmconv.compare.report import divergence_line, gate_note, measured, next_step, print_table
from glmconv.compare.verdict import MARGIN, STREAM_FLOOR
from glmconv.mistakes import runtime_note
from glmconv.models.conventions import CHOICES, SERVE_ALIAS
from glmconv.text import console as text_console
from glmconv.text import count, printable, table_width
from glmconv_cli.output import echo_json
from glmconv_cli.sizes import SEED, SEED_HELP


@click.command("parity")
@click.argument("hf_dir", type=click.Path(path_type=Path))
@click.argument("mcore_dir", type=click.Path(path_type=Path))
@click.option("--tokens", type=int, default=None, help=f"Random tokens to run (default {D.DEFAULT_TOKENS}).")
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None,
              help="Token ids instead of random ones: one sequence per line (whitespace-separated ids) or JSON "
                   "list(s) of ids; several sequences run as one packed batch.")


@click.option("--sequences", type=int, default=None,
              help="Split the random tokens into K packed sequences (default 1).")


@click.option("--seed", type=SEED, default=D.DEFAULT_SEED, show_default=True,
              help=f"Seed of the random tokens ({SEED_HELP}).")
@click.option("--mode", type=click.Choice(D.PARITY_MODES), default=D.DEFAULT_MODE, show_default=True,
              help="propagated: each side runs on its own; isolated: every sub-block (and the head, so the logit "
                   "metrics then compare heads only) gets the serve side's input.")


@click.option("--dtype", type=click.Choice(D.PARITY_DTYPES), default=D.DEFAULT_PARITY_DTYPE, show_default=True,
              help="Weights and activations of both models (bf16 keeps in fp32 what the reference keeps in fp32); "
                   "each side is also run as its fp32 torch-reference twin, which measures the run's own noise.")


@click.option("--device", default=D.DEFAULT_PARITY_DEVICE, show_default=True,
              help="torch device for both models (cpu, cuda, cuda:1).")


@click.option("--train-conventions", type=click.Choice(D.TRAIN_CONVENTIONS), default=D.DEFAULT_TRAIN_CONVENTIONS,
              show_default=True,
              help="The train side's starting conventions: Megatron's defaults for MCORE_DIR's layout (mcore: "
                   "indexer_kpool=off, megatron-core's token-level DSA indexer), or serve's (aligned).")


@click.option("--train-convention", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one train-side convention (repeatable): "
                   + "; ".join(f"{key}={'|'.join(values)}" for key, values in CHOICES.items())
                   + f". KEY={SERVE_ALIAS} sets one to serve's value, a bare '{SERVE_ALIAS}' all of them.")


@click.option("--threshold", type=float, default=None,
              help=f"The floor: the smallest stream rel err (on the fp32 references, or beyond {MARGIN:g}x the "
                   f"measured noise) named as a divergence (default {STREAM_FLOOR:g}).")


@click.option("--fail-on", "fail_on", multiple=True, metavar="METRIC>VALUE",
              help="Gate on these bounds instead of the verdict (repeatable; add 'divergences>0' to keep the "
                   "verdict too, else a note says the divergence it names is not gated): the condition that fails, "
                   "METRIC>VALUE, METRIC>=VALUE, METRIC<VALUE or METRIC<=VALUE, e.g. 'excess.max>4' (rel err over "
                   "the measured noise; an error over a noise of 0 is unbounded and breaks it, the failure saying "
                   "where), 'ref_rel_err.max>1e-4', 'logprob_abs_diff.max>1e-4', 'top1_agreement<0.99', 'kl>=1e-6'. "
                   "A metric this run does not measure (expert_excess.max without MoE layers) is refused, exit 2.")


@click.option("--self-test", is_flag=True,
              help="Also plant each defect of the catalog in memory (conversion defects, convention slips, and "
                   "kernel-path defects in the train side's kernel calls alone) and report whether the verdict names "
                   "each at its layer and sub-block: proof, on your own checkpoint, that the gate catches them. "
                   "Exit 1 when one is missed.")


@click.option("--defects", default=None, metavar="NAME,...",
              help="With --self-test (refused without it, exit 2): only these catalog defects ("
                   + ", ".join(DEFECT_NAMES) + ").")


@click.option("--report-dir", type=click.Path(path_type=Path), default=None,
              help="Write report.json, report.md and error_per_layer.png here (the PNG needs matplotlib: "
                   "pip install 'glmconv[report]').")


@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
@click.option("--kernels", type=click.Choice(D.KERNEL_CHOICES), default=D.DEFAULT_KERNELS, show_default=True,
              help="Train side ops: auto = fla KDA, tilelang SparseMLA and the triton kpool indexer on CUDA (the torch "
                   "references on CPU), each kernel call judged against its torch reference on the same input and a "
                   "bound a correct kernel meets (cause `kernel` beyond it); reference = torch everywhere, no kernel "
                   "checked; emulated = the kernel path with the references standing in (the checks and the "
                   "kernel-path self-test without a GPU).")


@click.option("--stream-layers", is_flag=True,
              help="Hold one decoder layer's weights at a time (embedding rows and head windows read as needed): "
                   "a full-size model in about one MoE layer of memory per side. Same numbers as without.")


@click.option("--replay", type=click.Choice(D.REPLAY_CHOICES), default=D.DEFAULT_REPLAY, show_default=True,
              help="The train side uses the serve side's selections: routing = its MoE expert ids (the gate weights "
                   "stay the train router's own scores at those experts, normalised as usual, as Megatron's routing "
                   "replay does), indexer = its DSA top-k token ids (shared-indexer layers too), both. Rel errs then "
                   "show the numerics alone; the overlap column still shows the train side's own selection.")


@click.option("--replay-file", type=click.Path(path_type=Path), default=None,
              help="Replay these selections instead of the serve side's: a safetensors file with routed_experts "
                   "[MoE layers, tokens, top_k] and/or indexer_topk [DSA layers, tokens, width] (what an RL engine "
                   "captured for the same tokens), checked before use.")


@click.option("--train-backend", type=click.Choice(D.TRAIN_BACKENDS), default=D.DEFAULT_TRAIN_BACKEND,
              show_default=True,
              help="The train side's DSA attention and MoE sub-blocks: glmconv = glmconv's model with the train "
                   "conventions; megatron = megatron-core's own AbsorbedMLASelfAttention+DSAttention and MoELayer, "
                   "built from the config as a trainer builds them and loaded from MCORE_DIR (mcore layout) through "
                   "megatron-core's dist_checkpointing (KDA, mHC, norms, embedding and head stay glmconv's).")


@click.option("--allow-different-weights", is_flag=True,
              help="Compare even when MCORE_DIR is not a conversion of HF_DIR (e.g. a checkpoint trained further).")


def parity(hf_dir: Path, mcore_dir: Path, tokens: int | None, prompt_file: Path | None, sequences: int | None,
           seed: int, mode: str, dtype: str, device: str, train_conventions: str, overrides: tuple[str, ...],
           threshold: float | None, fail_on: tuple[str, ...], report_dir: Path | None, as_json: bool,
           allow_different_weights: bool, kernels: str, stream_layers: bool, replay: str,
           replay_file: Path | None, self_test: bool, defects: str | None, train_backend: str) -> None:
    """Run the serve model (HF_DIR) and the train model (MCORE_DIR) side by side and compare every sub-block.

    Exit 0 when the verdict names no divergence (or, with --fail-on, no bound breaks), 1 when it does, 2 on a
    usage or input error. The verdict: a sub-block diverges when its weights differ, when a kernel of the train
    side's kernel path is beyond its bound against its torch reference on the same input, when train and serve
    differ on the fp32 references (weights and conventions alone) beyond --threshold, or when the observed error
    exceeds twice the noise the run measured on that input with correct code (its dtype; the kernels' share only
    while they are within their bounds).
    """

    check_self_test(self_test, defects)  # before anything is read
    report = api.parity(hf_dir, mcore_dir, tokens=tokens, sequences=sequences, prompt_file=prompt_file,
                        fail_on=fail_on, threshold=threshold, report_dir=report_dir, seed=seed, mode=mode,
                        dtype=dtype, device=device, train_conventions=train_conventions, overrides=overrides,
                        progress=not as_json, allow_different_weights=allow_different_weights, kernels=kernels,
                        stream_layers=stream_layers, replay=replay, replay_file=replay_file, self_test=self_test,
                        defects=defects, train_backend=train_backend)
    paths = [Path(p) for p in report.get("report_files", [])]
    if as_json:
        echo_json(report, indent=2)
    else:
        _print(report, paths)
    for note in [*report.get("report_skipped", []), runtime_note(report.get("config_keys_ignored", [])),
                 gate_note(report)]:
        if note:
            click.echo(printable(f"note: {note}"), err=True)
    if not report["passed"]:
        click.echo(printable(f"parity failed: {failure(report)}"), err=True)
        sys.exit(1)


def failure(report: dict) -> str:
    """What failed the gate, in one line."""

    broken = [b["bound"] + (f" ({measured(b)})" if b["value"] is None else "") for b in report["bounds"]
              if b["broken"]]
    missed = [r["defect"] for r in report.get("self_test", []) if not r["named"]]
    parts = [f"{count(len(broken), 'bound')} broken: {', '.join(broken)}"] if broken else []
    parts += [divergence_line(report)] if report["gate"] == "verdict" and report["first_divergence"] else []
    parts += [step] if (step := next_step(report)) else []
    parts += [f"self-test missed {', '.join(missed)}"] if missed else []
    return "; ".join(parts)


def _print(report: dict, paths: list[Path]) -> None:
    console = text_console()
    print_table(report, console, table_width(console))
    for p in paths:
        console.print(printable(f"wrote {p}"), markup=False, highlight=False, soft_wrap=True)
    console.print(f"took {report['wall_s']:.2f}s in all (loading both models, then their forward passes: "
                  f"{report['elapsed_s']:.2f}s)", markup=False, highlight=False, soft_wrap=True)
