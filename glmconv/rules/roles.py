"""What each tensor is to a model. Every rule of the table carries one of these roles; the models, the fixture
initialisers and the parity fingerprint look tensors up by role, so no code outside the rules matches names.

A text-model role names one mapping per layer (or per model); vision roles name kinds of tensor.
"""

from __future__ import annotations

EMBED, FINAL_NORM, LM_HEAD = "embed", "final_norm", "lm_head"
ATTN_NORM, MLP_NORM = "attn_norm", "mlp_norm"

HC_SITES = ("attn", "ffn")
HC: dict[str, tuple[str, str, str]] = {s: (f"hc_{s}.fn", f"hc_{s}.base", f"hc_{s}.scale") for s in HC_SITES}
HC_FN = frozenset(h[0] for h in HC.values())
HC_BASE = frozenset(h[1] for h in HC.values())
HC_SCALE = frozenset(h[2] for h in HC.values())

KDA_PROJECTIONS = ("q", "k", "v", "b", "f_a", "f_b", "g_a", "g_b", "o")
KDA_PROJ = {p: f"kda.{p}_proj" for p in KDA_PROJECTIONS}
KDA_CONV, KDA_A_LOG, KDA_DT_BIAS, KDA_O_NORM = "kda.conv", "kda.A_log", "kda.dt_bias", "kda.o_norm"

DSA_Q_A, DSA_Q_A_NORM, DSA_Q_B = "dsa.q_a", "dsa.q_a_norm", "dsa.q_b"
DSA_KV_A, DSA_KV_A_NORM, DSA_KV_B, DSA_O_PROJ = "dsa.kv_a", "dsa.kv_a_norm", "dsa.kv_b", "dsa.o_proj"

INDEXER_WQ_B, INDEXER_WK, INDEXER_WEIGHTS_PROJ = "indexer.wq_b", "indexer.wk", "indexer.weights_proj"
INDEXER_K_NORM_WEIGHT, INDEXER_K_NORM_BIAS = "indexer.k_norm_weight", "indexer.k_norm_bias"
INDEXER_COMPRESS_GATE, INDEXER_COMPRESS_APE = "indexer.compress_gate", "indexer.compress_ape"

DENSE_FC1, DENSE_FC2 = "dense.fc1", "dense.fc2"
MOE_ROUTER, MOE_EXPERT_BIAS = "moe.router", "moe.expert_bias"
MOE_SHARED_FC1, MOE_SHARED_FC2 = "moe.shared_fc1", "moe.shared_fc2"
MOE_EXPERTS_FC1, MOE_EXPERTS_FC2 = "moe.experts_fc1", "moe.experts_fc2"

MTP_ENORM, MTP_HNORM, MTP_EH_PROJ, MTP_FINAL_NORM = "mtp.enorm", "mtp.hnorm", "mtp.eh_proj", "mtp.final_norm"

VISION_NORM, VISION_BIAS, VISION_MATRIX = "vision.norm", "vision.bias", "vision.matrix"

NORMS = frozenset({FINAL_NORM, ATTN_NORM, MLP_NORM, KDA_O_NORM, DSA_Q_A_NORM, DSA_KV_A_NORM, INDEXER_K_NORM_WEIGHT,
                   MTP_ENORM, MTP_HNORM, MTP_FINAL_NORM, VISION_NORM})
BIASES = frozenset({INDEXER_K_NORM_BIAS, VISION_BIAS})

SWIGLU_FC1 = frozenset({DENSE_FC1, MOE_SHARED_FC1, MOE_EXPERTS_FC1})  # gate and up halves (the gate meets the clamp)
