"""The transformer's attention side: RMSNorm, rotary position embeddings and causal self-attention, for the
full-sequence forward (fused ``scaled_dot_product_attention``) and for incremental decoding over a KV slab
(``forward_cached`` with ``attention_bias``). moe.py builds the blocks from these; its docstring describes
the three paths and the position rule.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from t1async.model.config import MoEConfig

__all__ = ["Attention", "RMSNorm", "attention_bias", "rotary", "rotary_angles", "rotary_into"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rotary_angles(pos: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, n, D/2] for absolute positions pos [B, n] (fp32)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=pos.device) / head_dim))
    ang = pos.to(torch.float32)[:, None, :, None] * inv
    return ang.cos(), ang.sin()


def attention_bias(pos: Tensor, n_heads: int, dtype: torch.dtype) -> Tensor:
    """Additive causal mask over a KV slab for queries at positions pos [B, n], with W = max(pos) + 1 key
    positions: 0 where key position <= the query's position, -inf elsewhere. Shaped for
    ``Attention.forward_cached``: [B * n_heads, 1, W] when decoding (n = 1), [B, 1, n, W] for a prefill."""
    b, n = pos.shape
    w = int(pos.max()) + 1
    allowed = torch.arange(w, device=pos.device)[None, None, :] <= pos[:, :, None]  # [B, n, W]
    bias = torch.zeros(b, n, w, dtype=dtype, device=pos.device).masked_fill_(~allowed, float("-inf"))
    if n > 1:
        return bias[:, None]
    return bias.expand(b, n_heads, w).reshape(b * n_heads, 1, w)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., B, H, n, D] (half-split convention), computing in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def rotary_into(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Inference rotary (no autograd): x [B, n, ..., D] in the projection's own layout, cos/sin [B, 1, n, D/2]
    from ``rotary_angles``. Four ops into one fresh buffer instead of ``rotary``'s temporaries (a prefill's
    are megabytes each); the same rotation up to float rounding (multiply-adds)."""
    b, n = x.shape[:2]
    half = x.shape[-1] // 2
    shape = (b, n) + (1,) * (x.dim() - 3) + (half,)
    c, s = cos[:, 0].reshape(shape), sin[:, 0].reshape(shape)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1.0)
    torch.mul(x2, c, out=o2).addcmul_(x1, s)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings. ``qkv`` is one fused projection whose output rows are the
    query heads, then the key heads, then the value heads ([(H + 2 KV) hd, d]; KV < H is grouped-query
    attention, query head j reading key/value head j // (H / KV), as Hugging Face's ``repeat_kv``), with
    biases where ``cfg.qkv_bias`` (Qwen2). With
    ``cfg.qk_norm`` each query and key head is RMS-normalised (``q_norm``, ``k_norm``, weights [hd]) before
    the rotary embedding (Qwen3); with ``cfg.qk_norm_full`` one norm covers all query heads and one all key
    heads (weights [H hd], [KV hd]), and ``cfg.clip_qkv`` clamps the projections (OLMoE)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (h + 2 * kv) * hd, bias=cfg.qkv_bias)
        self.out = nn.Linear(h * hd, cfg.d_model, bias=False)
        qn, kn = (h * hd, kv * hd) if cfg.qk_norm_full else (hd, hd)
        self.q_norm = RMSNorm(qn, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(kn, cfg.norm_eps) if cfg.qk_norm else None
        self.gqa = kv != h

    def _project(self, x: Tensor) -> Tensor:
        """The fused projection [B, n, (H + 2 KV) hd], with OLMoE's whole-projection q/k norms and clip."""
        y = self.qkv(x)
        c = self.cfg
        if c.qk_norm_full and self.q_norm is not None and self.k_norm is not None:
            q, k, v = y.split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], -1)
            y = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        if c.clip_qkv:
            y = y.clamp(-c.clip_qkv, c.clip_qkv)
        return y

    def _norm_qk(self, x: Tensor, dim: int) -> Tensor:
        """RMS-normalise the query and key heads of x (heads along ``dim``: H query heads, then KV key heads)."""
        if self.q_norm is None or self.k_norm is None or self.cfg.qk_norm_full:
            return x
        q, k = x.split([self.cfg.n_heads, self.cfg.n_kv_heads], dim=dim)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=dim)

    def _qkv(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        b, n, _ = x.shape
        h, kv, hd = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        if (
            not self.gqa and self.q_norm is None and not self.cfg.clip_qkv
        ):  # the in-house layout: one [3, B, H, n, hd] view
            qkv = self.qkv(x).view(b, n, 3, h, hd).permute(2, 0, 3, 1, 4)  # [3, B, H, n, hd]
            q, k = rotary(qkv[:2], *rope)  # q and k rotated in one go (elementwise: same numbers as one by one)
            return q, k, qkv[2]
        heads = self._project(x).view(b, n, h + 2 * kv, hd).transpose(1, 2)  # [B, H + 2 KV, n, hd]
        qk = rotary(self._norm_qk(heads[:, : h + kv], dim=1), *rope)
        return qk[:, :h], qk[:, h:], heads[:, h + kv :]

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
        if self.gqa:
            kw["enable_gqa"] = True
        return F.scaled_dot_product_attention(q, k, v, **kw)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None) -> Tensor:
        q, k, v = self._qkv(x, rope)
        if mask is None:
            o = self._sdpa(q, k, v, is_causal=True)
        else:
            o = self._sdpa(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(*x.shape[:2], -1))

    def forward_past(
        self, x: Tensor, rope: tuple[Tensor, Tensor], past_k: Tensor | None, past_v: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The training-path attention of tokens that follow ``P`` earlier ones whose keys and values are given
        (``past_k``/``past_v`` [B, KV, P, hd], held constant: no gradient reaches them; None: P = 0). ``rope``
        must be for the new tokens' absolute positions P.. P + n - 1. Returns (output [B, n, d], the new tokens'
        keys and values [B, KV, n, hd]), the latter to extend a prefix cache."""
        q, k, v = self._qkv(x, rope)
        if past_k is None or past_v is None or past_k.shape[2] == 0:
            o = self._sdpa(q, k, v, is_causal=True)
        else:
            p, n = past_k.shape[2], x.shape[1]
            kf, vf = torch.cat([past_k.to(k.dtype), k], dim=2), torch.cat([past_v.to(v.dtype), v], dim=2)
            allowed = torch.arange(p + n, device=x.device)[None, :] <= (p + torch.arange(n, device=x.device))[:, None]
            o = self._sdpa(q, kf, vf, attn_mask=allowed)  # [n, P + n]: every past key, new ones causally
        return self.out(o.transpose(1, 2).reshape(*x.shape[:2], -1)), k, v

    def forward_cached(
        self, x: Tensor, pos: Tensor, rope: tuple[Tensor, Tensor], kc: Tensor, vc: Tensor, bias: Tensor | None
    ) -> Tensor:
        """x [B, n, d]; pos [B, n]; kc/vc: slab views [B, KV, cap, hd]; bias from ``attention_bias`` (0 where
        a query may attend, -inf elsewhere), or None when every row's tokens sit at positions [0, n).
        Decoding (n = 1): one batched matmul each for scores and values, the slab views folding (B, KV) into
        one batch dimension without a copy (a key/value head's H / KV query heads as the matmul's rows).
        Prefill (n > 1): the fused scaled_dot_product_attention (no [B, H, n, W] score tensor)."""
        b, n, _ = x.shape
        h, kv, hd = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        heads = self._project(x).view(b, n, h + 2 * kv, hd)
        qk = rotary_into(self._norm_qk(heads[:, :, : h + kv], dim=2), *rope)  # [B, n, H + KV, hd]
        q = qk[:, :, :h].transpose(1, 2)  # [B, H, n, hd] (a view)
        knew, vnew = qk[:, :, h:], heads[:, :, h + kv :]  # [B, n, KV, hd]
        p0 = int(pos[0, 0])
        if n > 1 and bool((pos[:, 0] == p0).all()):  # rows at the same positions: a strided copy, no scatter
            kc[:, :, p0 : p0 + n] = knew.transpose(1, 2).to(kc.dtype)
            vc[:, :, p0 : p0 + n] = vnew.transpose(1, 2).to(vc.dtype)
        else:
            rows = torch.arange(b, device=x.device)[:, None].expand(b, n)
            kc[rows, :, pos, :] = knew.to(kc.dtype)
            vc[rows, :, pos, :] = vnew.to(vc.dtype)
        if bias is None:  # every row starts at position 0: plain causal attention over the n new tokens
            o = self._sdpa(q, kc[:, :, :n], vc[:, :, :n], is_causal=True)
            return self.out(o.transpose(1, 2).reshape(b, n, h * hd))
        w = bias.shape[-1]
        if n > 1:
            o = self._sdpa(q, kc[:, :, :w], vc[:, :, :w], attn_mask=bias)
            return self.out(o.transpose(1, 2).reshape(b, n, h * hd))
        g = h // kv  # query heads per key/value head: [B * KV, g, hd] rows against [B * KV, W, hd] keys
        kw, vw = kc[:, :, :w].reshape(b * kv, w, hd), vc[:, :, :w].reshape(b * kv, w, hd)
        qg, bg = q.reshape(b * kv, g, hd), bias.view(b * kv, g, w)
        scores = torch.baddbmm(bg, qg, kw.transpose(1, 2), alpha=1.0 / math.sqrt(hd))
        o = torch.bmm(torch.softmax(scores.float(), dim=-1).to(vw.dtype), vw)  # [B * KV, g, hd]
        return self.out(o.view(b, 1, h * hd))
