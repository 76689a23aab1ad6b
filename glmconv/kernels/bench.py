"""`glmconv bench kernels`: each GPU kernel against its torch reference on the same inputs at the real dims.

Real dims (GLM-5.3-Flash): indexer 32 heads x 128, kpool 4, top-k 2048 (+3 tail), hidden 4096, q_lora 1536;
KDA 64 heads x 128; DSA 64 heads, NoPE 256 + V 256, latent 512, sm_scale 1/16. Times are medians of CUDA
event timings (triton's do_bench, L2 flushed between runs), kernel and reference side by side in one process.
The input makers here are shared with tests/gpu.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glmconv.kernels import dsa
from glmconv.kernels.kda import kda_core
from glmconv.ops import dsa as dsa_reference
from glmconv.ops import kda as kda_reference
from glmconv.ops import kpool as kpool_reference
from glmconv.ops.kda import KdaParams, forget_gate
from glmconv.ops.kpool import K_NORM_EPS, IndexerTensors, KpoolParams

if TYPE_CHECKING:
    import torch


REAL_KPOOL = KpoolParams(heads=32, head_dim=128, topk=2048, kpool=4, select_tail=True)
REAL_KDA = KdaParams(heads=64, head_dim=128, lower_bound=-5.0, norm_eps=1e-5)
HIDDEN, Q_LORA, LATENT, DSA_HEADS, NOPE, V_DIM = 4096, 1536, 512, 64, 256, 256
PACKED = (4097, 2048, 1023, 130, 2)  # mixed lengths: longer, equal to, shorter than index_topk


def cu_seqlens(lengths: Sequence[int], device: str | torch.device) -> torch.Tensor:
    import torch

    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.long, device=device)


def indexer_inputs(tokens: int, device: str, dtype: torch.dtype | None = None, seed: int = 0,
                   p: KpoolParams = REAL_KPOOL, hidden: int = HIDDEN,
                   q_lora: int = Q_LORA) -> tuple[torch.Tensor, torch.Tensor, IndexerTensors]:
    """x [T, hidden], q_resid [T, q_lora] and indexer weights, random (fan-in scaled, never zeros)."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    w = IndexerTensors(wq_b=r(p.heads * p.head_dim, q_lora, scale=q_lora ** -0.5),
                       wk=r(p.head_dim, hidden, scale=hidden ** -0.5),
                       k_norm_weight=1 + r(p.head_dim, scale=0.1), k_norm_bias=r(p.head_dim, scale=0.05),
                       weights_proj=r(p.heads, hidden, scale=hidden ** -0.5),
                       compress_gate=r(p.head_dim, hidden, scale=hidden ** -0.5),
                       compress_ape=(torch.randn(p.kpool, p.head_dim, generator=g) * 0.5).to(device))
    return r(tokens, hidden), r(tokens, q_lora), w


def kda_inputs(tokens: int, device: str, dtype: torch.dtype | None = None, seed: int = 0,
               p: KdaParams = REAL_KDA) -> dict[str, torch.Tensor]:
    """q, k, v [T, H, K] (post-conv activations), raw gate input f [T, H*K], beta logits b [T, H], A_log, dt_bias."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    g = torch.Generator(device="cpu").manual_seed(seed)
    t, h, d = tokens, p.heads, p.head_dim
    dt = (torch.rand(h * d, generator=g) * math.log(100) + math.log(1e-3)).exp()
    out = {"q": torch.randn(t, h, d, generator=g), "k": torch.randn(t, h, d, generator=g),
           "v": torch.randn(t, h, d, generator=g), "f": torch.randn(t, h * d, generator=g),
           "b": torch.randn(t, h, generator=g)}
    out = {k: v.to(device, dtype) for k, v in out.items()}
    out["a_log"] = (torch.rand(h, generator=g) * 15 + 1).log().to(device)
    out["dt_bias"] = (dt + torch.log(-torch.expm1(-dt))).to(device)
    return out


def dsa_inputs(lengths: Sequence[int], topk_width: int, device: str, dtype: torch.dtype | None = None,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """q [T, 64, 256], latent [T, 512], kv_b [64*512, 512] and causal per-sequence random ids [T, W] (-1 padded)."""
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, DSA_HEADS, NOPE, generator=g)
    latent = torch.randn(t, LATENT, generator=g)
    kv_b = torch.randn(DSA_HEADS * (NOPE + V_DIM), LATENT, generator=g) * LATENT ** -0.5
    ids = torch.full((t, topk_width), -1, dtype=torch.long)
    start = 0
    for n in lengths:
        for i in range(n):
            k = min(i + 1, topk_width)
            ids[start + i, :k] = torch.randperm(i + 1, generator=g)[:k] + start
        start += n
    return {"q": q.to(device, dtype), "latent": latent.to(device, dtype), "kv_b": kv_b.to(device, dtype),
            "topk": ids.to(device)}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def same_sets(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[T] bool: each row selects the same set of ids (order and -1 padding aside)."""
    import torch

    width = max(got.shape[1], want.shape[1])
    g = torch.nn.functional.pad(got.long(), (0, width - got.shape[1]), value=-1).sort(-1).values
    w = torch.nn.functional.pad(want.long(), (0, width - want.shape[1]), value=-1).sort(-1).values
    return (g == w).all(-1)


def time_ms(fn: Callable[[], Any], rep_ms: int = 200) -> float:
    """Median of CUDA-event timings (triton's do_bench: warm-up first, L2 flushed before each run)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median"))


@dataclass
class Row:
    """One kernel-vs-reference line of the bench table."""

    op: str
    shape: str
    kernel_ms: float
    reference_ms: float
    reference: str
    check: str

    @property
    def speedup(self) -> float:
        return self.reference_ms / self.kernel_ms

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "shape": self.shape, "kernel_ms": round(self.kernel_ms, 4),
                "reference_ms": round(self.reference_ms, 4), "speedup": round(self.speedup, 3),
                "reference": self.reference, "check": self.check}


def bench_kpool(lengths: Sequence[int], device: str = "cuda") -> Row:
    from glmconv.kernels.kpool import kpool_topk as kernel  # triton: imported only where it runs

    reference = kpool_reference.kpool_topk

    x, q, w = indexer_inputs(sum(lengths), device)
    cu = cu_seqlens(lengths, device)
    got, want = kernel(x, q, w, REAL_KPOOL, cu), reference(x, q, w, REAL_KPOOL, cu)
    d = kpool_disagreements(x, q, w, REAL_KPOOL, cu, got, want)
    check = f"rows with other sets {d['differ']}/{d['rows']} (not near-ties: {d['beyond_tie']})"
    return Row("kpool indexer", f"T={sum(lengths)} seqs={list(lengths)}",
               time_ms(lambda: kernel(x, q, w, REAL_KPOOL, cu)), time_ms(lambda: reference(x, q, w, REAL_KPOOL, cu)),
               "glmconv torch kpool_topk", check)


def bench_kda(tokens: int, device: str = "cuda") -> list[Row]:
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    reference = kda_reference.chunk_kda

    p, a = REAL_KDA, kda_inputs(tokens, device)
    cu = cu_seqlens([tokens], device)
    bare_in = [a[k].unsqueeze(0) for k in ("q", "k", "v")]
    f4 = a["f"].view(1, tokens, p.heads, p.head_dim)

    def bare() -> Any:
        return fla_chunk_kda(*bare_in, f4, a["b"].unsqueeze(0), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=p.lower_bound,
                             A_log=a["a_log"], dt_bias=a["dt_bias"], cu_seqlens=cu)

    def ours() -> torch.Tensor:
        return kda_core(a["q"], a["k"], a["v"], a["f"], a["b"], a["a_log"], a["dt_bias"], p, cu)

    def ref() -> torch.Tensor:
        g = forget_gate(a["f"], a["a_log"], a["dt_bias"], p)
        return reference(a["q"], a["k"], a["v"], g, torch.sigmoid(a["b"].float()), cu)

    err = rel_err(ours(), ref())
    shape = f"T={tokens} H={p.heads} K=V={p.head_dim}"
    t_ours, t_bare = time_ms(ours), time_ms(bare)
    return [Row("KDA (glmconv kda_core)", shape, t_ours, time_ms(ref, rep_ms=500), "glmconv torch chunk_kda fp32",
                f"rel err {err:.2e}"),
            Row("KDA (glmconv kda_core)", shape, t_ours, t_bare, "bare fla chunk_kda", "same call")]


def bench_dsa(tokens: int, device: str = "cuda") -> list[Row]:
    import torch

    reference = dsa_reference.sparse_mla
    width = REAL_KPOOL.width
    a = dsa_inputs([tokens], width, device)
    scale = NOPE ** -0.5
    ids = dsa.kernel_indices(a["topk"])
    w = a["kv_b"].view(DSA_HEADS, NOPE + V_DIM, LATENT)
    q_abs = torch.nn.functional.pad(torch.einsum("thd,hdr->thr", a["q"], w[:, :NOPE]), (0, dsa.KV_DIM - LATENT))
    kv = torch.nn.functional.pad(a["latent"], (0, dsa.KV_DIM - LATENT)).contiguous()
    q_abs = q_abs.contiguous()

    def ours() -> torch.Tensor:
        return dsa.sparse_mla(a["q"], a["latent"], a["kv_b"], ids, V_DIM, scale)

    def bare() -> torch.Tensor:
        return dsa.attend_latent(q_abs, kv, ids, scale)

    def ref() -> torch.Tensor:
        return reference(a["q"].float(), a["latent"].float(), a["kv_b"].float(), a["topk"], V_DIM, scale)

    err = rel_err(ours(), ref())
    shape = f"S={tokens} H={DSA_HEADS} topk={ids.shape[1]}"
    t_ours, t_bare = time_ms(ours), time_ms(bare)
    return [Row("DSA SparseMLA (glmconv sparse_mla)", shape, t_ours, time_ms(ref, rep_ms=500),
                "glmconv torch sparse_mla fp32", f"rel err {err:.2e}"),
            Row("DSA SparseMLA (glmconv sparse_mla)", shape, t_ours, t_bare, "bare tilelang kernel",
                "incl. absorb/pad/un-absorb")]


def run(tokens: int = 8192, packed: Sequence[int] = PACKED, dsa_tokens: int = 4096,
        device: str = "cuda") -> list[Row]:
    """The whole table: kpool (one sequence, packed), KDA, DSA."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        return [bench_kpool([tokens], device), bench_kpool(list(packed), device), *bench_kda(tokens, device),
                *bench_dsa(dsa_tokens, device)]


def kpool_disagreements(x: torch.Tensor, q_resid: torch.Tensor, w: IndexerTensors, p: KpoolParams,
                        cu: torch.Tensor, got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> dict[str, int]:
    """Rows whose selected sets differ, and how many of them are NOT near-ties in fp64.

    A differing row is a near-tie when the worst pool each side chose scores the same in fp64 up to
    rtol x the row's largest score (the two sides only ordered near-equal scores differently).
    """
    import torch
    import torch.nn.functional as F

    from glmconv.kernels.kpool import layout  # triton: imported only where it runs

    rows = (~same_sets(got, want)).nonzero().flatten().tolist()
    if not rows:
        return {"rows": got.shape[0], "differ": 0, "beyond_tie": 0}
    t = x.shape[0]
    iq = F.linear(q_resid, w.wq_b).view(t, p.heads, p.head_dim).double()
    ik = F.layer_norm(F.linear(x, w.wk), (p.head_dim,), w.k_norm_weight, w.k_norm_bias, K_NORM_EPS).double()
    head_w = (F.linear(x, w.weights_proj).float() * p.heads ** -0.5).double()
    lay = layout(cu, t, p.kpool, p.topk // p.kpool)
    starts = lay.pool_tok[lay.pool_tok >= 0].long()
    idx = starts[:, None] + torch.arange(p.kpool, device=x.device)
    if w.compress_gate is None or w.compress_ape is None:  # the token-level indexer: a pool is one token
        keys = ik[starts]
    else:
        gate = F.linear(x, w.compress_gate).double()
        keys = ((gate[idx] + w.compress_ape.double()).softmax(1) * ik[idx]).sum(1)  # [P, d]
    beyond = 0
    for r in rows:
        limit = r - int(lay.tail[r])  # ids above are the query's own tail, not a pool choice
        lo, hi = int(lay.lo[r]), int(lay.hi[r])
        scores = (torch.relu(iq[r] @ keys[lo:hi].t() * p.head_dim ** -0.5) * head_w[r][:, None]).sum(0)
        worst = []
        for sel in (got[r], want[r]):
            ids = sel[(sel >= 0) & (sel <= limit)].long()
            pools = torch.searchsorted(starts, ids, right=True) - 1 - lo
            worst.append(float(scores[pools].min()))
        if abs(worst[0] - worst[1]) > rtol * float(scores.abs().max()):
            beyond += 1
    return {"rows": t, "differ": len(rows), "beyond_tie": beyond}
