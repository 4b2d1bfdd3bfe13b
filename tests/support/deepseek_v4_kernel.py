"""DeepSeek V4's inference kernels (`inference/kernel.py` of deepseek-ai/DeepSeek-V4-Flash,
TileLang; plus `fast_hadamard_transform`, a CUDA package) as plain float32 torch, for
`tests/support/deepseek_v4_reference.py`, DeepSeek's `inference/model.py`.

Same names and signatures as DeepSeek's kernel.py; what each computes:
- `act_quant(x, ..., inplace=True)` and `fp4_act_quant(x, ..., inplace=True)`: DeepSeek
  rounds x in place through FP8 / FP4 and back, simulating the precision its training
  saw (QAT). In float32 they leave x as it is: the reference computes in float32 like
  exo and transformers, and the rounding is no part of the architecture.
- `fp8_gemm` / `fp4_gemm`: never reached (the reference's weights are float32, so
  `linear` takes its F.linear branch); they raise rather than compute something else.
- `sparse_attn`: the kernel's attention over gathered keys (index -1 = no key), values =
  keys, softmax scale, and the head's sink added to the denominator as exp(sink - max)
  with the max over the real scores, in float32.
- `hc_split_sinkhorn`: the kernel's pre / post / comb split, line for line (sigmoid + eps,
  2 * sigmoid, row softmax + eps, then one column and `iters - 1` row/column
  normalisations, each dividing by sum + eps).
- `hadamard_transform(x, scale)`: x @ H * scale with H the Sylvester Hadamard matrix, as
  `fast_hadamard_transform` computes it."""

import torch


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    if not inplace:
        raise NotImplementedError("FP8 activations only feed fp8_gemm, which float32 weights never reach")
    return x


def fp4_act_quant(x: torch.Tensor, block_size: int = 32, inplace: bool = False):
    if not inplace:
        raise NotImplementedError("FP4 activations only feed fp4_gemm, which float32 weights never reach")
    return x


def fp8_gemm(a, a_s, b, b_s, scale_dtype=torch.float32):
    raise NotImplementedError("float32 weights take linear's F.linear branch")


def fp4_gemm(a, a_s, b, b_s, scale_dtype=torch.float32):
    raise NotImplementedError("float32 weights take linear's F.linear branch")


def sparse_attn(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """q [b, m, h, d], kv [b, n, d], attn_sink [h], topk_idxs [b, m, topk] -> [b, m, h, d]."""
    b, m, h, d = q.shape
    valid = topk_idxs != -1
    index = topk_idxs.clamp_min(0).long()
    keys = torch.gather(kv.float().unsqueeze(1).expand(b, m, -1, d), 2, index.unsqueeze(-1).expand(-1, -1, -1, d))
    scores = torch.einsum("bmhd,bmkd->bmhk", q.float(), keys) * softmax_scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    scores_max = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - scores_max)
    sum_exp = weights.sum(dim=-1, keepdim=True) + torch.exp(attn_sink.float()[:, None] - scores_max)
    return (torch.einsum("bmhk,bmkd->bmhd", weights, keys) / sum_exp).to(q.dtype)


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int = 4,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
):
    """mixes [b, s, (2 + hc) * hc] -> pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc]."""
    hc = hc_mult
    pre = torch.sigmoid(mixes[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * hc_scale[1] + hc_base[hc : 2 * hc])
    comb = mixes[..., 2 * hc :].unflatten(-1, (hc, hc)) * hc_scale[2] + hc_base[2 * hc :].view(hc, hc)
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    n = x.size(-1)
    if n & (n - 1):
        raise ValueError(f"the Hadamard transform needs a power-of-two width, not {n}")
    hadamard = torch.ones(1, 1, dtype=x.dtype)
    while hadamard.size(0) < n:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    return (x @ hadamard) * scale
