"""`glmconv parity`: inputs, --fail-on parsing, and the driver end to end on a fake model pair.

The fake pair implements the GlmModel API (embed / attention / mlp / head, aux top-k and experts) with the
same random weights on both sides; the train side adds a 1% error at one sub-block, which the report must
name. Integration tests against the real models live further down and are skipped until they land.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import glmconv.compare as parity_mod
from glmconv.compare import ParityOptions
from glmconv.compare.capture import capture
from glmconv.compare.inputs import load_prompt_file, random_batch
from glmconv.errors import GlmconvError
from glmconv.models.conventions import Conventions, Sides
from glmconv_cli.main import cli

VOCAB = 512  # the tiny preset's vocabulary (the driver reads HF_DIR's config.json)


class FakeModel:
    """A 4-layer stand-in with the GlmModel API: tanh residual blocks on hc streams, a router, a top-k."""

    attn_types = ("kda", "kda", "kda", "dsa")
    mlp_types = ("dense", "dense", "moe", "moe")
    num_layers = 4

    def __init__(self, error_at: tuple[int, str] | None = None, error: float = 0.01, hidden: int = 16,
                 hc: int = 4, experts: int = 8, k: int = 2, window: int = 6) -> None:
        g = torch.Generator().manual_seed(0)
        self.hc, self.k, self.window = hc, k, window
        self.emb = torch.randn(VOCAB, hidden, generator=g)
        self.w = {(layer, sub): torch.randn(hidden, hidden, generator=g) / hidden ** 0.5
                  for layer in range(4) for sub in ("attention", "mlp")}
        self.router = torch.randn(hidden, experts, generator=g)
        self.error_at, self.error = error_at, error

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[ids].unsqueeze(1).expand(-1, self.hc, -1).clone()

    def _block(self, layer: int, sub: str, x: torch.Tensor) -> torch.Tensor:
        y = x + torch.tanh(x @ self.w[(layer, sub)])
        return y * (1 + self.error) if self.error_at == (layer, sub) else y

    def attention(self, layer: int, x: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, dict]:
        aux = {"topk": self._topk(x, cu_seqlens)} if self.attn_types[layer] == "dsa" else {}
        return self._block(layer, "attention", x), aux

    def mlp(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        aux = {"experts": (x.mean(1) @ self.router).topk(self.k, -1).indices} if self.mlp_types[layer] == "moe" else {}
        return self._block(layer, "mlp", x), aux

    def _topk(self, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        """The `window` most similar earlier tokens of the same sequence, -1 padded (like the DSA indexer)."""
        h = x.mean(1)
        out = torch.full((h.shape[0], self.window), -1, dtype=torch.int32)
        for lo, hi in zip(cu.tolist(), cu.tolist()[1:]):
            for t in range(lo, hi):
                scores = h[lo:t + 1] @ h[t]
                out[t, :min(self.window, t + 1 - lo)] = scores.topk(min(self.window, t + 1 - lo)).indices.int() + lo
        return out

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return (x.mean(1) @ self.emb.T).float()


@pytest.fixture()
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    from glmconv.fixtures.configs import preset_config

    hf, mc = tmp_path / "hf", tmp_path / "mc"
    hf.mkdir()
    mc.mkdir()
    (hf / "config.json").write_text(json.dumps(preset_config("tiny")))
    return hf, mc


def _fake(monkeypatch: pytest.MonkeyPatch, error_at: tuple[int, str] | None, error: float = 0.01) -> None:
    conv = Sides(Conventions.serve(), Conventions.serve())
    monkeypatch.setattr(parity_mod, "build_models",
                        lambda config, opts: (FakeModel(), FakeModel(error_at, error), conv))


# ---- inputs -----------------------------------------------------------------------------------------------

def test_random_batch_is_seeded_and_packed() -> None:
    a, b = random_batch(VOCAB, 10, 3, seed=7), random_batch(VOCAB, 10, 3, seed=7)
    assert torch.equal(a.ids, b.ids) and a.cu_seqlens.tolist() == [0, 4, 7, 10]
    assert not torch.equal(a.ids, random_batch(VOCAB, 10, 3, seed=8).ids)
    assert int(a.ids.max()) < VOCAB and (a.tokens, a.sequences) == (10, 3)
    with pytest.raises(GlmconvError, match="exceeds"):
        random_batch(VOCAB, 2, 3)


@pytest.mark.parametrize("text,cu", [
    ("1 2 3\n\n4 5\n", [0, 3, 5]),
    ("[1, 2, 3]", [0, 3]),
    ("[[1, 2, 3], [4, 5]]", [0, 3, 5]),
    ("[1, 2, 3]\n[4, 5]\n", [0, 3, 5]),
])


def test_prompt_file_formats(tmp_path: Path, text: str, cu: list[int]) -> None:
    (tmp_path / "p").write_text(text)
    b = load_prompt_file(tmp_path / "p", VOCAB)
    assert b.ids.tolist() == [1, 2, 3, 4, 5][:cu[-1]] and b.cu_seqlens.tolist() == cu


@pytest.mark.parametrize("text,match", [
    ("1 two 3", "'two' is not a token id"), ("1 512", "outside the vocabulary"), ("", "no token ids"),
    ("1 \uff11\uff10", "'\uff11\uff10' is not a token id"), ("1 1_0", "'1_0' is not a token id"),
    ("+5", "'\\+5' is not a token id"), ("1 -2", "'-2' is not a token id"),
    ("1 " + "9" * 5000, "outside any vocabulary"),
    ("[1, [2]]", "JSON list"), ("[1, 2", "not valid JSON"), ("[[]]", "JSON list"), ("[true]", "JSON list"),
])


def test_prompt_file_errors(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "p").write_text(text)
    with pytest.raises(GlmconvError, match=match):
        load_prompt_file(tmp_path / "p", VOCAB)


def test_a_prompt_file_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    with pytest.raises(GlmconvError, match=r"p: not a regular file \(a directory\)$"):
        load_prompt_file(tmp_path / "p", VOCAB)


# ---- the driver on the fake pair ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_capture_localises_the_planted_error(mode: str) -> None:
    batch = random_batch(VOCAB, 32, 2, 0)
    cap = capture(FakeModel(), FakeModel((2, "mlp")), batch, mode)
    errs = [(r.layer, r.sub_block, r.rel_err) for r in cap.layers]
    assert all(e == 0.0 for _, _, e in errs[:5])
    assert errs[5][:2] == (2, "mlp") and errs[5][2] == pytest.approx(0.01, rel=1e-5)
    tail = [e for _, _, e in errs[6:]]
    assert all(e == pytest.approx(0.0, abs=1e-6) for e in tail) if mode == "isolated" else all(e > 1e-3 for e in tail)
    assert cap.layers[5].experts is not None and cap.layers[5].experts.overlap == 1.0
    assert cap.layers[6].topk is not None


def test_capture_refuses_different_models() -> None:
    other = FakeModel()
    other.attn_types = ("kda", "kda", "dsa", "dsa")  # type: ignore[misc]
    with pytest.raises(GlmconvError, match="different models"):
        capture(FakeModel(), other, random_batch(VOCAB, 8), "propagated")
    with pytest.raises(GlmconvError, match="--mode"):
        capture(FakeModel(), FakeModel(), random_batch(VOCAB, 8), "sideways")


def test_cli_names_layer_2_mlp_and_fails_the_bound(monkeypatch: pytest.MonkeyPatch, dirs: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    _fake(monkeypatch, (2, "mlp"))
    hf, mc = dirs
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--tokens", "48", "--sequences", "2",
                                   "--report-dir", str(tmp_path / "rep"), "--fail-on", "max_rel_err>1e-3",
                                   "--fail-on", "top1_agreement<0.5"])
    assert res.exit_code == 1, res.output
    assert "first divergence: layer 2 mlp" in res.output
    assert "parity failed: 1 bound broken: max_rel_err>0.001" in res.output
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["first_divergence"]["layer"] == 2 and report["first_divergence"]["sub_block"] == "mlp"
    assert [b["broken"] for b in report["bounds"]] == [True, False]
    assert (tmp_path / "rep" / "error_per_layer.png").stat().st_size > 1000


def test_report_dir_without_matplotlib_skips_only_the_plot(monkeypatch: pytest.MonkeyPatch,
                                                            dirs: tuple[Path, Path], tmp_path: Path) -> None:
    _fake(monkeypatch, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    hf, mc = dirs
    rep = tmp_path / "rep"
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--tokens", "16", "--report-dir", str(rep)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in rep.iterdir()) == ["glmconv.json", "report.json", "report.md"]  # no PNG
    hint = ("note: error_per_layer.png: skipped, matplotlib is not installed (pip install matplotlib, "
            "or pip install 'glmconv[report]')")
    assert [line for line in res.stderr.splitlines() if "matplotlib" in line] == [hint]
    assert json.loads((rep / "report.json").read_text())["report_skipped"] == [hint.removeprefix("note: ")]
    assert "error_per_layer.png" not in (rep / "report.md").read_text()


def test_cli_says_what_was_timed(monkeypatch: pytest.MonkeyPatch, dirs: tuple[Path, Path]) -> None:
    _fake(monkeypatch, None)
    hf, mc = dirs
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--tokens", "16", "--fail-on", "max_rel_err>1e-4"])
    assert res.exit_code == 0, res.output
    assert "ok: max_rel_err <= 0.0001 (measured 0.000e+00)" in res.output
    took = re.fullmatch(r"took (\d+\.\d\d)s in all \(loading both models, then their forward passes: (\d+\.\d\d)s\)",
                        res.output.splitlines()[-1])
    assert took is not None, res.output
    report = json.loads(CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--tokens", "16", "--json"]).stdout)
    assert report["wall_s"] >= report["elapsed_s"]  # the whole run contains the forward passes


def test_cli_json_and_passing_run(monkeypatch: pytest.MonkeyPatch, dirs: tuple[Path, Path]) -> None:
    _fake(monkeypatch, None)
    hf, mc = dirs
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--json", "--mode", "isolated",
                                   "--fail-on", "logprob_abs_diff.max>0", "--fail-on", "top1_agreement<1"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["first_divergence"] is None and report["passed"] and report["mode"] == "isolated"
    assert report["summary"]["max_rel_err"] == 0.0 and report["tokens"] == 128


def test_cli_prompt_file_packs_sequences(monkeypatch: pytest.MonkeyPatch, dirs: tuple[Path, Path],
                                        tmp_path: Path) -> None:
    _fake(monkeypatch, (0, "attention"))
    hf, mc = dirs
    (tmp_path / "ids.json").write_text(json.dumps([list(range(1, 30)), list(range(100, 140))]))
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--prompt-file", str(tmp_path / "ids.json"), "--json"])
    assert res.exit_code == 1, res.output  # without --fail-on the named divergence fails the run
    assert res.stderr.startswith("parity failed: first divergence: layer 0 attention (rel err 1.000e-02")
    report = json.loads(res.stdout)
    assert (report["tokens"], report["sequences"], report["inputs"]) == (69, 2, str(tmp_path / "ids.json"))
    assert report["logits"]["next_token_positions"] == 67
    assert report["first_divergence"]["layer"] == 0 and report["first_divergence"]["sub_block"] == "attention"


@pytest.mark.parametrize("args,match", [
    (["--fail-on", "kl"], "expected METRIC>VALUE"),
    (["--fail-on", "nonsense>1"], "unknown metric"),
    (["--fail-on", "kl>x"], "is not a number"),
    (["--fail-on", "kl=1"], "operator '=' is not one of <, <=, >, >="),
    (["--tokens", "8", "--prompt-file", "p.txt"], "--prompt-file sets the tokens"),
    (["--threshold", "0"], "must be positive"),
    (["--train-conventions", "serve", "--fail-on", "expert_overlap_min<1", "--tokens", "0"], "must be positive"),
])


def test_cli_usage_errors_exit_2(monkeypatch: pytest.MonkeyPatch, dirs: tuple[Path, Path], args: list[str],
                                 match: str) -> None:
    _fake(monkeypatch, None)
    hf, mc = dirs
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), *args])
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and match in res.output and "Traceback" not in res.output


def test_cli_defects_without_self_test_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                              dirs: tuple[Path, Path]) -> None:
    """--defects alone planted nothing and said nothing: a run that looked like a self-test."""
    from glmconv.compare.options import DEFECTS_NEED_SELF_TEST

    _fake(monkeypatch, None)
    hf, mc = dirs
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--tokens", "16", "--defects", "swapped_experts"])
    assert res.exit_code == 2 and res.output.splitlines() == [f"error: {DEFECTS_NEED_SELF_TEST}"]
    assert DEFECTS_NEED_SELF_TEST.startswith("--defects picks the defects --self-test plants")
    with pytest.raises(GlmconvError, match="^--defects picks"):  # the API refuses it too
        parity_mod.run_parity(ParityOptions(hf_dir=hf, mcore_dir=mc, defects="swapped_experts", progress=False))


def test_cli_bounds_replacing_a_named_divergence_say_so_once(monkeypatch: pytest.MonkeyPatch,
                                                            dirs: tuple[Path, Path]) -> None:
    _fake(monkeypatch, (2, "mlp"))
    hf, mc = dirs
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--tokens", "48", "--fail-on", "kl>=1"])
    assert res.exit_code == 0, res.output
    note = ("note: --fail-on replaces the verdict's gate: its first divergence (layer 2 mlp, cause numerics) does not "
            "fail this run; add --fail-on 'divergences>0' to fail on it too")
    assert [line for line in res.stderr.splitlines() if line.startswith("note:")] == [note]
    kept = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--tokens", "48", "--fail-on", "kl>=1",
                                    "--fail-on", "divergences>0"])
    assert kept.exit_code == 1 and "note:" not in kept.stderr


@pytest.mark.parametrize("tensors,match", [
    ({"routed_experts": torch.zeros(2, 16, 2, dtype=torch.int64)},
     "error: routing payload: all routed-expert ids are 0: the backend most likely bypassed routing capture"),
    ({"routed_experts": torch.tensor([[0, 1]]).repeat(2, 16, 1), "indexer_topk": torch.full((4, 16, 19), -1)},
     "error: indexer payload: 4 streams but the config has 1 DSA layer (one per DSA layer, in layer order; "
     "KDA layers have no indexer)"),
])


def test_cli_refuses_a_bad_replay_payload_exit_2(monkeypatch: pytest.MonkeyPatch, dirs: tuple[Path, Path],
                                                 tmp_path: Path, tensors: dict[str, torch.Tensor], match: str) -> None:
    """tiny: MoE layers 2 and 3, one DSA layer (3) among three KDA ones; 16 tokens."""
    from safetensors.torch import save_file

    _fake(monkeypatch, None)
    save_file(tensors, tmp_path / "payload.safetensors")
    hf, mc = dirs
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--tokens", "16", "--replay", "both",
                                   "--replay-file", str(tmp_path / "payload.safetensors")])
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [match]


def test_cli_missing_dirs_exit_2(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["parity", str(tmp_path / "nope"), str(tmp_path)])
    assert res.exit_code == 2 and "error:" in res.output


def test_options_threshold_default_is_the_floor_in_both_dtypes() -> None:
    o = ParityOptions(hf_dir=Path("a"), mcore_dir=Path("b"))
    assert o.effective_threshold == 1e-5
    assert ParityOptions(hf_dir=Path("a"), mcore_dir=Path("b"), dtype="bf16").effective_threshold == 1e-5
    assert math.isclose(ParityOptions(hf_dir=Path("a"), mcore_dir=Path("b"), threshold=3e-3).effective_threshold,
                        3e-3)


# ---- integration: the real models on converted fixtures ----------------------------------------------------
# Each scenario converts (a copy of) a fixture once per module; parity runs are direct `run_parity` calls.

def _models_or_skip() -> None:
    pytest.importorskip("glmconv.models.model", reason="glmconv.models has not landed yet")


def _convert(hf: Path, out: Path) -> Path:
    res = CliRunner().invoke(cli, ["convert", str(hf), str(out)])
    assert res.exit_code == 0, res.output
    return out


def _scaled_copy(src: Path, dst: Path, factors: dict[str, float]) -> Path:
    """A copy of an HF checkpoint with some tensors multiplied (same names, shapes, dtypes and shards)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    left = dict(factors)
    for shard in sorted(dst.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            names, meta = list(f.keys()), f.metadata()
            if not left.keys() & set(names):
                continue
            tensors = {n: f.get_tensor(n) for n in names}
        for n in left.keys() & set(names):
            tensors[n] = (tensors[n].float() * left.pop(n)).to(tensors[n].dtype)
        save_file(tensors, shard, metadata=meta)
    assert not left, f"not in the checkpoint: {sorted(left)}"
    return dst


def _swap_expert_gate_up(mcore: Path, dst: Path, layer: int, expert: int) -> Path:
    """A copy of a converted checkpoint whose expert's gate and up rows are swapped inside the stacked fc1.

    DCP stores each chunk as torch.save(tensor) at (offset, length) of a .distcp file; the patched chunk is
    re-saved in place (same shape and dtype, so the same length) and every other byte, .metadata included,
    is the converter's own.
    """
    import io
    import shutil

    from glmconv.io.torch_dist.reader import read_metadata

    shutil.copytree(mcore, dst)
    iter_dir = dst / "release"
    name = f"decoder.layers.{layer}.mlp.experts.experts.linear_fc1.weight"
    patched = 0
    for idx, info in read_metadata(iter_dir).storage_data.items():
        row = expert - idx.offset[0] if idx.fqn == name else -1
        raw = (iter_dir / info.relative_path).read_bytes() if row >= 0 else b""
        t = torch.load(io.BytesIO(raw[info.offset:info.offset + info.length]), weights_only=True) if raw else None
        if t is None or row >= t.shape[0]:
            continue
        half = t.shape[1] // 2
        t[row] = torch.cat([t[row, half:], t[row, :half]])
        buf = io.BytesIO()
        torch.save(t, buf)
        assert len(buf.getvalue()) == info.length
        end = info.offset + info.length
        (iter_dir / info.relative_path).write_bytes(raw[:info.offset] + buf.getvalue() + raw[end:])
        patched += 1
    assert patched == 1
    return dst


def _parity(hf: Path, mc: Path, **kw: object) -> dict:
    return parity_mod.run_parity(ParityOptions(hf_dir=hf, mcore_dir=mc, progress=False, **kw))  # type: ignore[arg-type]


def _where(report: dict) -> tuple[int, str] | None:
    fd = report["first_divergence"]
    return None if fd is None else (fd["layer"], fd["sub_block"])


@pytest.fixture(scope="module")
def tiny_mc(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    _models_or_skip()
    return _convert(tiny_ckpt, tmp_path_factory.mktemp("parity") / "mc-tiny")


@pytest.fixture(scope="module")
def cut8_mc(cut8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    _models_or_skip()
    return _convert(cut8_ckpt, tmp_path_factory.mktemp("parity") / "mc-cut8")


GATE_1 = "model.language_model.layers.1.mlp.gate_proj.weight"
FP32_NOISE = 1e-6  # bound on per-sub-block rel err for aligned fp32 runs (CPU runs are in fact bit-identical)


@pytest.fixture(scope="module")
def made_by_cli(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """init -> (HF dir, converted dir) of a fresh `glmconv fixture make --preset tiny` (no --init: the default)."""
    _models_or_skip()
    done: dict[str, tuple[Path, Path]] = {}

    def get(init: str) -> tuple[Path, Path]:
        if init not in done:
            d = tmp_path_factory.mktemp(f"parity-init-{init}")
            flags = [] if init == "default" else ["--init", init]
            res = CliRunner().invoke(cli, ["fixture", "make", str(d / "hf"), "--preset", "tiny", *flags])
            assert res.exit_code == 0, res.output
            done[init] = (d / "hf", _convert(d / "hf", d / "mc"))
        return done[init]
    return get


@pytest.fixture(scope="module")
def hot_gate(tiny_unit_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """tiny --init unit with layer 1's dense gate_proj x20, so the SwiGLU clamp (10) is active in that one sub-block.

    The unit init keeps gate/up pre-activations ~N(0, 1) behind the RMS norm, so nothing in it ever reaches 10
    (the max of ~20k normal draws is ~4.5); x20 puts ~30% of layer 1's gates above 10 (N(0, 20^2) > 10) and
    leaves every other sub-block below the limit. (The default init has hot gate rows in every MLP, layer 0 first.)
    """
    _models_or_skip()
    d = tmp_path_factory.mktemp("parity-hot-gate")
    hf = _scaled_copy(tiny_unit_ckpt, d / "hf", {GATE_1: 20.0})
    return hf, _convert(hf, d / "mc")


def _assert_noise_only(r: dict) -> None:
    assert r["first_divergence"] is None
    assert max(rec["rel_err"] for rec in r["layers"]) <= FP32_NOISE
    assert all(rec.get("expert_overlap", 1.0) == 1.0 and rec.get("topk_overlap", 1.0) == 1.0 for rec in r["layers"])
    assert r["logits"]["logprob_abs_diff"]["max"] <= 1e-5 and r["logits"]["top1_agreement"] == 1.0
    assert r["logits"]["kl"] <= 1e-10


@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_aligned_tiny_agrees_to_fp32_noise(tiny_ckpt: Path, tiny_mc: Path, mode: str) -> None:
    r = _parity(tiny_ckpt, tiny_mc, tokens=128, sequences=2, train_conventions="serve", mode=mode)
    _assert_noise_only(r)
    assert r["conventions"]["train"] == r["conventions"]["serve"]
    print(f"\ntiny parity ({mode}, fp32, 128 tokens in 2 sequences, 4 layers): {r['elapsed_s']:.2f}s")


def test_aligned_cut8_agrees_to_fp32_noise(cut8_ckpt: Path, cut8_mc: Path) -> None:
    r = _parity(cut8_ckpt, cut8_mc, tokens=128, sequences=2, train_conventions="serve")
    _assert_noise_only(r)
    assert len(r["layers"]) == 16 and sum("topk_overlap" in rec for rec in r["layers"]) == 2
    print(f"\ncut8 parity (propagated, fp32, 128 tokens, 8 layers): {r['elapsed_s']:.2f}s")


@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_hc_mix_bf16_is_named_at_layer_0_attention(tiny_ckpt: Path, tiny_mc: Path, mode: str) -> None:
    """Casting post/comb to bf16 perturbs the very first mix by ~2^-9 relative: ~1e-3 at layer 0 attention."""
    r = _parity(tiny_ckpt, tiny_mc, tokens=128, sequences=2, train_conventions="serve", mode=mode,
                overrides=("hc_mix=bf16",))
    assert _where(r) == (0, "attention") and r["first_divergence"]["value"] > 5e-4


@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_indexer_query_raw_is_named_at_the_dsa_layer(tiny_ckpt: Path, tiny_mc: Path, mode: str) -> None:
    """Sequences of 64 tokens > index_topk 16 (4 of up to 16 pools of 4): the raw query changes the top-k.

    The raw and normalised queries differ by a per-token scale (no effect on a ranking) and q_a_layernorm's
    elementwise weight, which reorders close pool scores; tiny's only DSA layer is 3.
    """
    r = _parity(tiny_ckpt, tiny_mc, tokens=128, sequences=2, train_conventions="serve", mode=mode,
                overrides=("indexer_query=raw",))
    assert _where(r) == (3, "attention")
    rec = r["layers"][6]
    assert rec["layer"] == 3 and rec["topk_overlap"] < 1.0 and rec["rel_err"] > 1e-2


def test_indexer_query_is_invisible_in_short_sequences(tiny_ckpt: Path, tiny_mc: Path) -> None:
    """Sequences no longer than index_topk select every visible token, whatever the query."""
    r = _parity(tiny_ckpt, tiny_mc, tokens=128, sequences=8, train_conventions="serve",
                overrides=("indexer_query=raw",))
    _assert_noise_only(r)


@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_proj_rms_is_named_at_layer_0_attention_on_a_default_fixture(made_by_cli: Any, mode: str) -> None:
    """The default (realistic) init puts the streams at RMS ~2e-3 (mean square ~4e-6): there rsqrt(ms + 1e-5) and
    1/(rms + 1e-6) differ by ~47%, which moves layer 0's post/comb coefficients (~6e-2 rel err, measured)."""
    hf, mc = made_by_cli("default")
    r = _parity(hf, mc, tokens=128, sequences=2, train_conventions="serve", mode=mode,
                overrides=("proj_rms=megatron",))
    assert _where(r) == (0, "attention") and r["first_divergence"]["value"] > 1e-2


def test_default_fixture_agrees_to_fp32_noise_with_aligned_conventions(made_by_cli: Any) -> None:
    hf, mc = made_by_cli("default")
    _assert_noise_only(_parity(hf, mc, tokens=128, sequences=2, train_conventions="serve"))


def test_proj_rms_is_rounding_sized_on_a_unit_init_fixture(made_by_cli: Any) -> None:
    """At --init unit's stream RMS ~1 the two eps forms differ by ~4e-6 relative: below the 1e-5 floor."""
    hf, mc = made_by_cli("unit")
    r = _parity(hf, mc, tokens=128, sequences=2, train_conventions="serve", overrides=("proj_rms=megatron",))
    assert r["first_divergence"] is None and 0 < r["summary"]["max_rel_err"] < 1e-5


def test_swiglu_clamp_off_is_named_at_layer_0_mlp_on_a_default_fixture(tiny_ckpt: Path, tiny_mc: Path) -> None:
    """The default init drives a few gate rows of every MLP past the clamp: the first dense MLP diverges."""
    r = _parity(tiny_ckpt, tiny_mc, tokens=128, sequences=2, train_conventions="serve",
                overrides=("swiglu_clamp=off",))
    assert _where(r) == (0, "mlp") and r["first_divergence"]["value"] > 1e-1


def test_swiglu_clamp_off_is_named_at_layer_1_mlp(hot_gate: tuple[Path, Path]) -> None:
    hf, mc = hot_gate
    _assert_noise_only(_parity(hf, mc, tokens=128, sequences=2, train_conventions="serve"))
    for mode in ("propagated", "isolated"):
        r = _parity(hf, mc, tokens=128, sequences=2, train_conventions="serve", mode=mode,
                    overrides=("swiglu_clamp=off",))
        assert _where(r) == (1, "mlp") and r["first_divergence"]["value"] > 1e-1, mode


@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_swapped_expert_rows_are_localised(tiny_ckpt: Path, tiny_mc: Path, tmp_path: Path, mode: str) -> None:
    """A conversion defect: expert 3's gate and up rows swapped in layer 2's stacked linear_fc1."""
    bad = _swap_expert_gate_up(tiny_mc, tmp_path / "mc-bad", layer=2, expert=3)
    r = _parity(tiny_ckpt, bad, tokens=128, sequences=2, train_conventions="serve", mode=mode)
    assert _where(r) == (2, "mlp") and r["first_divergence"]["value"] > 1e-2
    rec = r["layers"][5]
    assert rec["expert_overlap"] == 1.0  # routing is untouched: the expert's output is what differs
    if mode == "isolated":
        assert all(x["rel_err"] <= FP32_NOISE for i, x in enumerate(r["layers"]) if i != 5)


def test_cli_default_train_conventions_fail_the_gate(tiny_ckpt: Path, tiny_mc: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["parity", str(tiny_ckpt), str(tiny_mc), "--tokens", "64", "--fail-on",
                                   "top1_agreement<1.0", "--fail-on", "kl>1", "--report-dir", str(tmp_path)])
    assert res.exit_code == 1, res.output
    assert "first divergence: layer 0 attention" in res.output and "broken: top1_agreement<1" in res.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["conventions"]["train"]["hc_mix"] == "bf16" and report["conventions"]["serve"]["hc_mix"] == "fp32"
    assert [b["broken"] for b in report["bounds"]] == [True, False]


def test_cli_bad_convention_override_exit_2(tiny_ckpt: Path, tiny_mc: Path) -> None:
    res = CliRunner().invoke(cli, ["parity", str(tiny_ckpt), str(tiny_mc), "--train-convention", "hc_mix=fp64"])
    assert res.exit_code == 2 and "error:" in res.output and "hc_mix" in res.output


def test_cli_refuses_checkpoints_of_different_models(tiny_ckpt: Path, cut8_mc: Path) -> None:
    res = CliRunner().invoke(cli, ["parity", str(tiny_ckpt), str(cut8_mc)])
    assert res.exit_code == 2 and res.stderr.strip() == (
        f"error: {cut8_mc} is not a conversion of {tiny_ckpt}: another model (first_k_dense_replace: 3 in {cut8_mc}, "
        f"2 in {tiny_ckpt}; num_hidden_layers: 8 in {cut8_mc}, 4 in {tiny_ckpt}; 4 other keys)"), res.output


# ---- replay: selection disagreement told from numerical error ------------------------------------------------

ROUTER_BIAS_2 = "model.language_model.layers.2.mlp.gate.e_score_correction_bias"


@pytest.fixture(scope="module")
def bias_flip(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny converted with layer 2's router bias doubled on the Megatron side (~1e-2 per expert): the bias steers
    only the selection, so ~5% of layer 2's expert choices flip while the router scores stay bit-identical."""
    _models_or_skip()
    d = tmp_path_factory.mktemp("parity-bias-flip")
    return _convert(_scaled_copy(tiny_ckpt, d / "hf", {ROUTER_BIAS_2: 2.0}), d / "mc")


def _assert_replayed_to_noise(r: dict, weights_at: tuple[int, str] | None = None) -> None:
    """What an aligned run measures (`_assert_noise_only`), the overlaps aside: those stay the own selections, and
    a replayed selection is not judged (the train side did not run it); differing weights still are."""
    assert _where(r) == weights_at and max(rec["rel_err"] for rec in r["layers"]) <= FP32_NOISE
    assert r["logits"]["logprob_abs_diff"]["max"] <= 1e-5 and r["logits"]["top1_agreement"] == 1.0
    assert r["logits"]["kl"] <= 1e-10


@pytest.mark.parametrize("mode", ["propagated", "isolated"])
def test_replay_indexer_removes_the_raw_query_from_the_numerics(tiny_ckpt: Path, tiny_mc: Path, mode: str) -> None:
    """Measured: layer 3's own top-k overlap 0.937 and rel err 8.5e-2 without replay; rel err 0 with it."""
    kw: dict[str, Any] = dict(tokens=128, sequences=2, train_conventions="serve", mode=mode,
                              overrides=("indexer_query=raw",))
    plain, replayed = _parity(tiny_ckpt, tiny_mc, **kw), _parity(tiny_ckpt, tiny_mc, replay="indexer", **kw)
    assert plain["layers"][6]["topk_overlap"] < 0.97 and plain["layers"][6]["rel_err"] > 1e-2
    _assert_replayed_to_noise(replayed)
    assert replayed["layers"][6]["topk_overlap"] == plain["layers"][6]["topk_overlap"]  # the disagreement, still
    assert replayed["layers"][6]["replayed"] == "topk" and replayed["replay"] == "indexer"


def test_replay_routing_removes_a_router_bias_flip_from_the_numerics(tiny_ckpt: Path, bias_flip: Path) -> None:
    """Measured: layer 2's own expert overlap 0.949 and rel err 7.1e-2 without replay; rel err 0 with it (the gate
    weights are the train router's own scores at the replayed experts, and those scores are the serve side's)."""
    kw: dict[str, Any] = dict(tokens=128, sequences=2, train_conventions="serve")
    plain, replayed = _parity(tiny_ckpt, bias_flip, **kw), _parity(tiny_ckpt, bias_flip, replay="routing", **kw)
    assert _where(plain) == (2, "mlp") and plain["layers"][5]["expert_overlap"] < 0.97
    assert plain["layers"][5]["rel_err"] > 1e-2
    _assert_replayed_to_noise(replayed, weights_at=(2, "mlp"))  # the doubled bias is a weight difference all the same
    assert replayed["first_divergence"]["cause"] == "weights"
    assert replayed["first_divergence"]["weight_diffs"][0]["field"] == "moe.expert_bias"
    assert replayed["layers"][5]["expert_overlap"] == plain["layers"][5]["expert_overlap"]
    assert [rec.get("replayed") for rec in replayed["layers"]][4:] == [None, "experts", None, "experts"]


@pytest.mark.parametrize("replay,where", [("routing", (2, "mlp")), ("indexer", (2, "mlp")), ("both", (2, "mlp"))])
def test_each_replay_removes_only_its_own_selection_difference(tiny_ckpt: Path, bias_flip: Path, replay: str,
                                                               where: tuple[int, str] | None) -> None:
    """Both differences planted (the bias flip at layer 2's MoE, the raw indexer query at layer 3's DSA)."""
    r = _parity(tiny_ckpt, bias_flip, tokens=128, sequences=2, train_conventions="serve",
                overrides=("indexer_query=raw",), replay=replay)
    assert _where(r) == where  # the bias is a weight difference: named whatever is replayed
    assert r["layers"][5]["diverged"] and r["layers"][6]["diverged"] == (replay != "both")  # own query, or upstream
    if replay == "both":
        _assert_replayed_to_noise(r, weights_at=(2, "mlp"))
        assert r["layers"][5]["expert_overlap"] < 1.0 and r["layers"][6]["topk_overlap"] < 1.0


def _serve_selections(hf: Path, mc: Path, batch: Any) -> dict[str, torch.Tensor]:
    """The serve side's expert ids and indexer top-k over `batch`, stacked as a replay file holds them."""
    from glmconv.io.config_file import load_config

    serve, _, _ = parity_mod.build_models(load_config(hf), ParityOptions(hf_dir=hf, mcore_dir=mc))
    experts, topk = [], []
    with torch.inference_mode():
        x = serve.embed(batch.ids)
        for layer in range(serve.num_layers):
            x, aux = serve.attention(layer, x, batch.cu_seqlens)
            topk += [aux["topk"]] if "topk" in aux else []
            x, aux = serve.mlp(layer, x)
            experts += [aux["experts"]] if "experts" in aux else []
    return {"routed_experts": torch.stack(experts), "indexer_topk": torch.stack(topk)}


def test_a_replay_file_of_the_serve_selections_replays_like_the_serve_side(tiny_ckpt: Path, bias_flip: Path,
                                                                           tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file(_serve_selections(tiny_ckpt, bias_flip, random_batch(VOCAB, 128, 2, 0)), tmp_path / "p.safetensors")
    kw: dict[str, Any] = dict(tokens=128, sequences=2, train_conventions="serve", overrides=("indexer_query=raw",),
                              replay="both")
    r = _parity(tiny_ckpt, bias_flip, replay_file=tmp_path / "p.safetensors", **kw)
    _assert_replayed_to_noise(r, weights_at=(2, "mlp"))
    assert r["replay_source"] == str(tmp_path / "p.safetensors")
    assert r["layers"] == [{**rec, "wall_s": r["layers"][i]["wall_s"], "load_s": r["layers"][i]["load_s"]}
                           for i, rec in enumerate(_parity(tiny_ckpt, bias_flip, **kw)["layers"])]


def test_cli_replay_is_named_in_the_table_and_the_report(tiny_ckpt: Path, tiny_mc: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["parity", str(tiny_ckpt), str(tiny_mc), "--tokens", "128", "--sequences", "2",
                                   "--train-conventions", "serve", "--train-convention", "indexer_query=raw",
                                   "--replay", "indexer", "--report-dir", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    line = ("replay indexer: the train side ran the serve side's indexer top-k; rel errs are the numerics under "
            "replay, overlaps the train side's own selection vs serve's")
    lines = res.stdout.splitlines()
    title_lines = lines[:next(i for i, line in enumerate(lines) if line.lstrip().startswith("┏"))]
    title = " ".join(" ".join(title_lines).split())  # rich wraps the title to the table's width
    assert title == "glmconv parity: propagated, fp32, 128 tokens in 2 sequences, replay indexer" and line in res.output
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert (report["replay"], report["replay_source"]) == ("indexer", "serve")
    assert f"- {line}" in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.slow
def test_parity_gate_script(tmp_path: Path) -> None:
    """scripts/parity_gate.sh as CI runs it: passes on aligned conventions, fails (1) with a planted one."""
    import subprocess
    import sys

    _models_or_skip()
    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "WORK": str(tmp_path / "w"), "TOKENS": "64"}
    ok = subprocess.run(["bash", str(root / "scripts" / "parity_gate.sh")], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (tmp_path / "w" / "parity-report" / "report.json").is_file()
    bad = subprocess.run(["bash", str(root / "scripts" / "parity_gate.sh"), "--train-convention", "hc_mix=bf16"],
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and "parity failed: first divergence: layer 0 attention" in bad.stderr
    assert "the clean pair itself diverges" in bad.stdout  # the self-test needs an aligned pair to tell defects apart
