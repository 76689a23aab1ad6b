"""The numerical conventions on which a serving stack and a naive Megatron port of GLM-5.3-Flash differ.

Each switch reproduces one known train-vs-serve divergence (design/glm5_next.md), so a parity run can
bisect them one at a time. `serve()` is HF/sglang; `train_default()` is what a faithful naive Megatron
port computes, in the checkpoint's Megatron layout (glmconv.rules.layouts): a trainer on megatron-core's native
modules (the mcore layout) also runs the token-level DSA indexer instead of the learned kpool one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from glmconv.defaults import MCORE, MILES
from glmconv.errors import GlmconvError

CHOICES: dict[str, tuple[str, ...]] = {
    "proj_rms": ("reference", "megatron"),
    "indexer_query": ("normed", "raw"),
    "swiglu_clamp": ("10", "off"),
    "output_contraction": ("mean", "learned"),
    "hc_mix": ("fp32", "bf16"),
    "indexer_kpool": ("learned", "off"),
}
SERVE_ALIAS = "serve"

# Where each switch acts: "attention" / "mlp" (every sub-block of that kind), "selection" (the DSA indexer's
# top-k: a DSA attention sub-block), "head" (the logits). Parity names the switches acting where it diverges.
SELECTION, HEAD = "selection", "head"
ACTS_AT: dict[str, tuple[str, ...]] = {
    "proj_rms": ("attention", "mlp", HEAD),
    "indexer_query": (SELECTION,),
    "swiglu_clamp": ("mlp",),
    "output_contraction": (HEAD,),
    "hc_mix": ("attention", "mlp"),
    "indexer_kpool": (SELECTION,),
}


class ConventionError(GlmconvError):
    """An unknown convention key or value."""


@dataclass(frozen=True)
class Conventions:
    """One value per switch; the defaults are serve's."""

    proj_rms: str = "reference"  # mHC flat RMS: rsqrt(mean(x^2) + rms_eps) | megatron: 1/(rms(x) + 1e-6)
    indexer_query: str = "normed"  # kpool indexer query from the normalised q_resid | raw q_a_proj output
    swiglu_clamp: str = "10"  # silu(min(gate, 10)) * clamp(up, +-10) | off: plain SwiGLU
    output_contraction: str = "mean"  # final hc streams: plain mean | learned (needs hc_head_* tensors)
    hc_mix: str = "fp32"  # post/comb residual mix in fp32 (sglang) | bf16 (HF casts post/comb to bf16)
    # DSA indexer: learned kpool pooling (compress gate/ape, pools of index_kpool, tail) | off: megatron-core's
    # token-level indexer (pools of one token, no gate/ape, no tail, top index_topk tokens)
    indexer_kpool: str = "learned"

    def __post_init__(self) -> None:
        for key, allowed in CHOICES.items():
            value = getattr(self, key)
            if value not in allowed:
                raise ConventionError(f"convention {key}={value!r}: choose from {', '.join(allowed)}")

    @classmethod
    def serve(cls) -> Conventions:
        """HF/sglang: reference RMS, normalised indexer query, clamp 10, mean contraction, fp32 mix, kpool indexer."""
        return cls()

    @classmethod
    def train_default(cls, has_hc_head: bool = False, layout: str = MILES) -> Conventions:
        """A faithful naive Megatron port in `layout` (the checkpoint's Megatron layout), one line per divergence:

        proj_rms=megatron: Megatron's hyper-connection computes r = 1/(rms(x) + 1e-6), eps outside the root.
        indexer_query=raw: Megatron fuses q_a_layernorm into linear_q_up_proj, so the indexer sees raw q.
        swiglu_clamp=off: Megatron's SwiGLU (chunk(2), silu(gate) * up) has no clamp.
        output_contraction=learned only where hc_head_* tensors exist (never in GLM-5.3-Flash), else mean.
        hc_mix=bf16: a bf16 trainer mixes the streams in the activation dtype, post/comb cast to bf16, as HF.
        indexer_kpool=off in the mcore layout only: Megatron-Bridge's GLM-5.3-Flash DSA runs megatron-core's
            token-level indexer (it has no parameter for the compress gate/ape); miles runs the kpool indexer.
        """
        return cls(proj_rms="megatron", indexer_query="raw", swiglu_clamp="off",
                   output_contraction="learned" if has_hc_head else "mean", hc_mix="bf16",
                   indexer_kpool="off" if layout == MCORE else "learned")

    def with_overrides(self, items: list[str] | tuple[str, ...]) -> Conventions:
        """Apply `KEY=VALUE` items in order; `serve` resets every switch, `KEY=serve` resets one."""
        out = self
        for item in items:
            out = out._apply(item.strip())
        return out

    def _apply(self, item: str) -> Conventions:
        if item == SERVE_ALIAS:
            return Conventions.serve()
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in CHOICES:
            known = ", ".join(CHOICES)
            raise ConventionError(f"convention override {item!r}: expected KEY=VALUE with KEY one of {known} "
                                  f"(or '{SERVE_ALIAS}')")
        if value == SERVE_ALIAS:
            value = getattr(Conventions.serve(), key)
        return dataclasses.replace(self, **{key: value})

    def diverging(self) -> list[str]:
        """The switches set differently from serve's."""
        serve = Conventions.serve()
        return [k for k in CHOICES if getattr(self, k) != getattr(serve, k)]

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, str]) -> Conventions:
        """A report's conventions read back (switches it does not name keep serve's value)."""
        return cls(**{k: v for k, v in values.items() if k in CHOICES})


@dataclass(frozen=True)
class Sides:
    """Both sides' conventions of a parity run."""

    serve: Conventions
    train: Conventions

    def as_dict(self) -> dict[str, dict[str, str]]:
        return {"serve": self.serve.as_dict(), "train": self.train.as_dict()}


def acting_at(serve: Conventions, train: Conventions, site: str) -> list[str]:
    """`KEY=VALUE` of the train switches set differently from serve's that act at `site` (an ACTS_AT site)."""
    return [f"{k}={getattr(train, k)}" for k in CHOICES
            if getattr(train, k) != getattr(serve, k) and site in ACTS_AT[k]]


def acting_at_sub_block(serve: Conventions, train: Conventions, sub_block: str, dsa: bool) -> list[str]:
    """`KEY=VALUE` of the differing train switches acting at a sub-block (at a DSA attention the indexer's too)."""
    sites = [sub_block] + ([SELECTION] if dsa and sub_block == "attention" else [])
    out: list[str] = []
    for site in sites:
        out += [s for s in acting_at(serve, train, site) if s not in out]
    return out
