"""The embedded decoder-only MoE transformer: one module, three paths.

    model = MoETransformer(MoEConfig(...))            # weights initialised deterministically from cfg.seed

One module for every supported architecture (design §2 "Models"): the in-house model, Qwen3-MoE, Qwen2-MoE
and Mixtral are configs of it (grouped-query attention, q/k norm, qkv bias, dense layers, a shared expert,
tied embeddings, the two gate rules; see config.py). A dense layer's rows in ``routing`` are zeros.

1. Full-sequence forward (training, scoring)::

       out = model(input_ids, replay=None, attention_mask=None)   # input_ids: LongTensor [B, T]
       out.logits        float [B, T, V]     next-token logits (model dtype); None with ``logits=False``
       out.hidden        float [B, T, d]     the lm_head's input (final-norm hidden states)
       out.values        float32 [B, T]      scalar value head (actor-critic)
       out.routing       long [B, T, L, K]   the experts each MoE layer actually used
       out.free_topk     long [B, T, L, K]   the experts the live router would choose (routing drift = differ)
       out.router_logits float32 [B, T, L, E]

2. Routing replay (R3): ``replay`` is a LongTensor [B, T, L, K] of recorded experts. Each (token, layer) uses
   the recorded experts; a row holding any -1 is "missing" and routes freely. Gates are always
   ``softmax(router_logits[chosen])`` (the top-k of a softmax, renormalised), so under replay the router
   keeps its gradient and an exact replay of the free choice reproduces the free forward bit for bit.

3. Incremental decoding over a ``KVCache`` slab (see kvcache.py)::

       logits, topk = model.forward_cached(input_ids [B, n], cache, slot0, start [B])

   Row b is cache slot ``slot0 + b``; its token j sits at position ``start[b] + j``. Keys/values are written
   into the slab and each query attends to slab positions ``<= start[b] + j``. ``logits_at`` [B] restricts
   the (costly) lm_head to one token per row, for prefill. ``topk`` [B, n, L, K] are the
   experts chosen for every fed token at every layer (the routing the sampler records).

   Training wants only the log-prob of each next token, never the [B, T, V] logits (at 32k tokens and a
   4096 vocabulary those are 512 MB, at Qwen3's 151,936 20 GB, and log-softmax and its gradient hold three
   more copies): pass ``logits=False`` and take ``model.token_logprobs(out.hidden, input_ids)``, which runs
   the lm_head in chunks of ``logprob_chunk(V)`` positions (``LOGPROB_BYTES`` of fp32 logits) under
   activation checkpointing (each chunk's logits are recomputed in the backward pass), so the head's memory
   is one chunk's whatever T and whatever V. Attention is always the fused
   ``scaled_dot_product_attention`` (flash kernel, no [T, T] score matrix) when no ``attention_mask`` is given.
   ``checkpoint_blocks=True`` keeps only each block's input under autograd and recomputes the block in the
   backward pass (one more forward; activation memory ~d floats a token a layer plus one block's worth).
   Recomputing is deterministic, so R3 replay and the free routing are the same in both passes.

Positions: rotary embeddings use absolute positions; with ``attention_mask`` (1 = real token) positions are
``cumsum(mask) - 1``, so left or right padding both work. Attention is causal. The attention side (RMSNorm,
rotary embeddings, ``Attention``, ``attention_bias``) is attention.py; the MoE layer and the model are here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from t1async.model.attention import Attention, RMSNorm, attention_bias, rotary_angles
from t1async.model.config import MoEConfig

# grouped matmul (one op for all experts); torch >= 2.8 has it on CPU. Without it, both paths use the loop.
_grouped_mm = getattr(torch, "_grouped_mm", None)


LOGPROB_BYTES = 64 << 20  # fp32 logits per lm_head chunk in ``token_logprobs`` (the chunk is sized by the vocabulary)


def logprob_chunk(vocab_size: int) -> int:
    """Positions per lm_head chunk in ``token_logprobs``: as many as ``LOGPROB_BYTES`` of fp32 logits hold (4096
    at a 4096-token vocabulary, 110 at Qwen3's 151,936), at least 1."""
    return max(1, LOGPROB_BYTES // (4 * vocab_size))


class ExpertPath(StrEnum):
    """How ``MoE.forward`` applies the experts. ``GROUPED``: three grouped matmuls over the tokens sorted by
    expert, the same ops whatever the number of experts and no host sync. ``LOOP``: a Python loop of ~8 ops per
    expert after a ``tolist()``, kept as the reference the grouped path is tested against (and used where
    torch has no ``_grouped_mm``, and for float64, which it does not multiply)."""

    GROUPED = "grouped"
    LOOP = "loop"


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what _grouped_mm multiplies (not float64)


def _grouped_ok(x: Tensor) -> bool:
    """Whether the grouped path can run on x: torch has ``_grouped_mm`` and it takes the matmuls' dtype."""
    return _grouped_mm is not None and _compute_dtype(x) in _GROUPED_DTYPES


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in: autocast's where it is on for x's device, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _grouped_swiglu(xs: Tensor, ends: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, inplace: bool) -> Tensor:
    """SwiGLU experts on rows sorted by expert: rows ``[ends[e-1], ends[e])`` go through expert e. Three
    ``_grouped_mm`` calls; xs [M, d], ends int32 [E], weights [E, d, f] / [E, f, d] (one dtype) -> [M, d].

    ``_grouped_mm`` wants every row stride a multiple of 16 bytes (fp32 included; the "stride error" it raises
    otherwise is about that, or about a gradient with stride 0, which this layer never hands it): a d or f
    that is not (test-sized models) is zero-padded, which changes no sum. ``inplace`` (no autograd) reuses the
    [M, f] temporaries."""
    mm = _grouped_mm
    if mm is None:  # the callers check first
        raise RuntimeError("this torch has no _grouped_mm (torch >= 2.8 has it): use ExpertPath.LOOP")
    a = 16 // xs.element_size()
    d, f = w_gate.shape[1], w_gate.shape[2]
    pd, pf = -d % a, -f % a
    if pd or pf:
        xs = F.pad(xs, (0, pd))
        w_gate, w_up, w_down = F.pad(w_gate, (0, pf, 0, pd)), F.pad(w_up, (0, pf, 0, pd)), F.pad(w_down, (0, pd, 0, pf))
    g, u = mm(xs, w_gate, offs=ends), mm(xs, w_up, offs=ends)
    h = F.silu(g, inplace=True).mul_(u) if inplace else F.silu(g) * u
    y = mm(h, w_down, offs=ends)
    return y[:, :d] if pd else y


def _head_logprobs(h: Tensor, nxt: Tensor, weight: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """Log-prob of ``nxt`` [B, n] under ``h @ weight.T`` (and its entropy; zeros unless asked), float32."""
    lsm = torch.log_softmax(F.linear(h, weight).float(), dim=-1)
    lp = lsm.gather(-1, nxt[..., None].long()).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1) if with_entropy else torch.zeros_like(lp)
    return lp, ent


@dataclass(frozen=True)
class ModelOutput:
    logits: Tensor | None
    values: Tensor
    routing: Tensor
    free_topk: Tensor
    router_logits: Tensor
    hidden: Tensor | None = None  # [B, T, d] final-norm hidden states (the lm_head's input)
    kv: list[tuple[Tensor, Tensor]] | None = None  # with past/want_kv: each layer's new keys, values [B, KV, T, hd]


def _gates(logits: Tensor, chosen: Tensor, chosen_logits: Tensor, norm_topk_prob: bool) -> Tensor:
    """The chosen experts' weights, float32: the softmax over their logits (= softmax over all experts, top-k,
    renormalised: Mixtral, Qwen3 with ``norm_topk_prob``), or their softmax-over-all-experts probabilities."""
    if norm_topk_prob:
        return torch.softmax(chosen_logits.float(), dim=-1)
    return torch.softmax(logits.float(), dim=-1).gather(-1, chosen)


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP, d -> f -> d (weights as ``x @ w``)."""

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(d, f))
        self.w_up = nn.Parameter(torch.empty(d, f))
        self.w_down = nn.Parameter(torch.empty(f, d))

    def forward(self, x: Tensor) -> Tensor:
        return (F.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down


class MoE(nn.Module):
    """Top-k routed SwiGLU experts. Gates: softmax over the chosen experts' router logits (``norm_topk_prob``,
    the in-house model's rule), else the chosen experts' softmax-over-all probabilities. With
    ``cfg.shared_d_ff`` a shared expert (``shared``) adds ``sigmoid(shared_gate(x)) * shared(x)`` for every
    token (Qwen2-MoE). ``path`` says how the experts are applied (``ExpertPath``; grouped by default)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
        self.router = nn.Linear(d, e, bias=False)
        self.w_gate = nn.Parameter(torch.empty(e, d, f))
        self.w_up = nn.Parameter(torch.empty(e, d, f))
        self.w_down = nn.Parameter(torch.empty(e, f, d))
        self.shared = SwiGLU(d, cfg.shared_d_ff) if cfg.shared_d_ff else None
        self.shared_gate = nn.Linear(d, 1, bias=False) if cfg.shared_d_ff else None
        self.path = ExpertPath.GROUPED if _grouped_mm is not None else ExpertPath.LOOP

    def _shared(self, x: Tensor, out: Tensor) -> Tensor:
        """out + the shared expert's gated output for x (out unchanged without a shared expert)."""
        if self.shared is None or self.shared_gate is None:
            return out
        return out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)

    def forward(self, x: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [N, d]; replay [N, K] or None. Returns (out [N, d], chosen [N, K], free [N, K], logits [N, E])."""
        logits = self.router(x)
        free = torch.topk(logits, self.cfg.top_k, dim=-1).indices
        if replay is None:
            chosen = free
        else:
            missing = (replay < 0).any(dim=-1, keepdim=True)
            chosen = torch.where(missing, free, replay)
        gates = _gates(logits, chosen, logits.gather(1, chosen), self.cfg.norm_topk_prob).to(x.dtype)
        if self.path == ExpertPath.LOOP or not _grouped_ok(x):  # float64 too: the loop
            out = self._loop(x, chosen, gates)
        else:
            out = self._grouped(x, chosen, gates, inplace=False)
        return self._shared(x, out), chosen, free, logits

    def _grouped(self, x: Tensor, chosen: Tensor, gates: Tensor, inplace: bool) -> Tensor:
        """The routed experts' gated sum for each token of x [N, d] (chosen, gates [N, K]): the N * K (token,
        expert) rows sorted by expert, three grouped matmuls, one scatter-add. A fixed number of ops whatever
        the number of experts, and no host sync (the group ends come from ``searchsorted``, on the device).
        Under autocast the matmuls run in its dtype, as the loop's ``@`` does."""
        flat = chosen.reshape(-1)
        experts, order = torch.sort(flat, stable=True)
        grid = torch.arange(self.cfg.n_experts, device=flat.device, dtype=experts.dtype)
        ends = torch.searchsorted(experts, grid, right=True).to(torch.int32)
        tok = order // chosen.shape[1]
        dt = _compute_dtype(x)
        ws = (self.w_gate.to(dt), self.w_up.to(dt), self.w_down.to(dt))
        ys = _grouped_swiglu(x.index_select(0, tok).to(dt), ends, *ws, inplace=inplace)
        g = gates.reshape(-1)[order, None]
        ys = ys.mul_(g) if inplace else ys * g
        out = torch.zeros_like(x)
        return out.index_add_(0, tok, ys.to(out.dtype))

    def _loop(self, x: Tensor, chosen: Tensor, gates: Tensor) -> Tensor:
        """``_grouped``'s result by a Python loop over the experts (``ExpertPath.LOOP``, the reference)."""
        out = torch.zeros_like(x)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.n_experts).tolist()
        tok_sorted = order // self.cfg.top_k
        gate_sorted = gates.reshape(-1)[order]
        lo = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            tok = tok_sorted[lo : lo + c]
            xe = x.index_select(0, tok)
            he = F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])
            ye = (he @ self.w_down[e]) * gate_sorted[lo : lo + c, None]
            out.index_add_(0, tok, ye)
            lo += c
        return out

    def infer(self, x: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Inference (no replay, no grad): x [N, d] -> (out [N, d], chosen [N, K]), as ``forward`` computes
        them, the experts applied as ``_grouped`` applies them with its temporaries reused in place. With
        ``keep`` (token indices) every token is routed but only the kept ones go through the experts: out is
        [len(keep), d]."""
        if not _grouped_ok(x):
            out, chosen = self.forward(x)[:2]
            return (out if keep is None else out[keep]), chosen
        logits = self.router(x)
        top = torch.topk(logits, self.cfg.top_k, dim=-1)
        chosen = top.indices
        gates = _gates(logits, chosen, top.values, self.cfg.norm_topk_prob).to(x.dtype)
        if keep is not None:
            x, sel, gates = x[keep], chosen[keep], gates[keep]
        else:
            sel = chosen
        # in place: a prefill's [N * K, d_ff] temporaries are megabytes, fresh pages each time
        return self._shared(x, self._grouped(x, sel, gates, inplace=True)), chosen


class DenseMLP(nn.Module):
    """A dense SwiGLU MLP (Qwen3's ``mlp_only_layers``) with the MoE layer's interface. It routes nothing: its
    chosen and free "experts" are zeros, the rows SGLang's capture leaves for a dense layer, which the learner
    drops as an all-zero layer (design §6); a replay's rows for it are ignored; its router logits are zeros."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, f = cfg.d_model, cfg.dense_d_ff
        self.w_gate = nn.Parameter(torch.empty(d, f))
        self.w_up = nn.Parameter(torch.empty(d, f))
        self.w_down = nn.Parameter(torch.empty(f, d))

    def _mlp(self, x: Tensor) -> Tensor:
        return (F.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down

    def _none(self, x: Tensor) -> Tensor:
        return torch.zeros(x.shape[0], self.cfg.top_k, dtype=torch.long, device=x.device)

    def forward(self, x: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        none = self._none(x)
        return self._mlp(x), none, none, x.new_zeros(x.shape[0], self.cfg.n_experts)

    def infer(self, x: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        none = self._none(x)
        return self._mlp(x if keep is None else x[keep]), none


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, dense: bool = False) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe: MoE | DenseMLP = DenseMLP(cfg) if dense else MoE(cfg)

    def forward(
        self,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor | None,
        replay: Tensor | None,
        past: tuple[Tensor, Tensor] | None = None,
        want_kv: bool = False,
    ) -> tuple[Tensor, ...]:
        """One training-path block: (h out, chosen [B, T, K], free [B, T, K], router logits [B, T, E]). With
        ``want_kv`` the tokens follow ``past``'s constant keys and values (``Attention.forward_past``) and their
        own keys and values are appended to the tuple. (Always through ``__call__``: FSDP hooks it.)"""
        if not want_kv:
            return self._moe(h + self.attn(self.attn_norm(h), rope, mask), replay)
        a, k, v = self.attn.forward_past(self.attn_norm(h), rope, *(past or (None, None)))
        return (*self._moe(h + a, replay), k, v)

    def _moe(self, h: Tensor, replay: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        b, n, d = h.shape
        flat_replay = None if replay is None else replay.reshape(b * n, -1)
        out, chosen, free, logits = self.moe(self.moe_norm(h).reshape(b * n, d), flat_replay)
        return h + out.view(b, n, d), chosen.view(b, n, -1), free.view(b, n, -1), logits.view(b, n, -1)


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig, *, init: bool = True) -> None:
        """``init=False`` leaves the parameters as allocated (for a load that overwrites them all: built on
        the meta device, that allocates nothing until ``to_empty``, see ``weights.load_pretrained``)."""
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i in cfg.dense_layers) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.value_head = nn.Linear(cfg.d_model, 1)
        if init:
            self.reset_parameters()

    def set_expert_path(self, path: ExpertPath) -> None:
        """Apply every MoE layer's experts by ``path`` (``ExpertPath.LOOP``: the reference the tests compare
        the grouped path with)."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.path = path

    @torch.no_grad()
    def reset_value_head(self) -> None:
        """A fresh value head for a checkpoint without one (a Hugging Face model): normal(0, init_std) weights
        from ``cfg.seed``'s own stream, bias 0."""
        rng = np.random.default_rng(self.cfg.seed)
        w = self.value_head.weight
        w.copy_(torch.from_numpy(rng.standard_normal(tuple(w.shape), dtype=np.float32) * np.float32(self.cfg.init_std)))
        self.value_head.bias.zero_()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from ``cfg.seed`` with numpy's PCG64 (stable across torch versions and
        platforms): normal(0, init_std) for matrices, init_std / sqrt(2 L) for residual outputs, ones for
        norms, zeros for the value head's bias. Parameters are filled in name order (a tied lm_head is the
        embedding, filled once)."""
        rng = np.random.default_rng(self.cfg.seed)
        resid_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "value_head.bias":
                p.zero_()
            else:
                std = resid_std if name.endswith(("attn.out.weight", "w_down")) else self.cfg.init_std
                arr = rng.standard_normal(tuple(p.shape), dtype=np.float32) * np.float32(std)
                p.copy_(torch.from_numpy(arr))

    def _check_replay(self, replay: Tensor, b: int, t: int) -> None:
        c = self.cfg
        want = (b, t, c.n_layers, c.top_k)
        if tuple(replay.shape) != want:
            raise ValueError(f"replay has shape {tuple(replay.shape)}, expected [B, T, L, K] = {list(want)}")
        if replay.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise ValueError(f"replay must be an integer tensor of expert ids, got dtype {replay.dtype}")
        if c.dense_layers:  # a dense layer routes nothing: its columns are not looked at
            replay = replay[:, :, list(c.moe_layers)]
        if replay.numel() and (int(replay.max()) >= c.n_experts or int(replay.min()) < -1):
            raise ValueError(
                f"replay holds expert ids outside [-1, {c.n_experts}): min {int(replay.min())}, max {int(replay.max())}"
            )
        if c.top_k > 1:
            s = torch.sort(replay.long(), dim=-1).values
            dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
            if bool(dup.any()):
                where = [int(i) for i in dup.nonzero()[0][:3]]
                raise ValueError(
                    f"replay repeats an expert within one (token, layer) row, first at [b, t, l] = {where}"
                )

    def forward(
        self,
        input_ids: Tensor,
        *,
        replay: Tensor | None = None,
        attention_mask: Tensor | None = None,
        logits: bool = True,
        checkpoint_blocks: bool = False,
        past: Sequence[tuple[Tensor, Tensor]] | None = None,
        want_kv: bool = False,
    ) -> ModelOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if replay is not None:
            self._check_replay(replay, b, t)
            replay = replay.long()
        if past is not None or want_kv:
            if attention_mask is not None:
                raise ValueError("past/want_kv take right-padded rows: no attention_mask")
            return self._forward_past(input_ids, replay, logits, checkpoint_blocks, past)
        if attention_mask is None:
            pos = torch.arange(t, device=input_ids.device)[None, :].expand(b, t)
            mask = None
        else:
            am = attention_mask.bool()
            pos = (am.long().cumsum(-1) - 1).clamp(min=0)
            causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
            eye = torch.eye(t, dtype=torch.bool, device=input_ids.device)
            mask = ((causal[None] & am[:, None, :]) | eye[None])[:, None]  # [B, 1, T, T]
        rope = rotary_angles(pos, self.cfg.head_dim, self.cfg.rope_theta)
        h = self.embed(input_ids)
        chosen, free, rlog = [], [], []
        ckpt = checkpoint_blocks and torch.is_grad_enabled()
        for i, blk in enumerate(self.blocks):
            rp = None if replay is None else replay[:, :, i]
            if ckpt:  # keep only the block's input; its activations are recomputed in the backward pass
                h, c, f, lg = checkpoint(blk, h, rope, mask, rp, use_reentrant=False)
            else:
                h, c, f, lg = blk(h, rope, mask, rp)
            chosen.append(c)
            free.append(f)
            rlog.append(lg.float())
        return self._output(h, chosen, free, rlog, logits)

    def _forward_past(
        self,
        input_ids: Tensor,
        replay: Tensor | None,
        logits: bool,
        checkpoint_blocks: bool,
        past: Sequence[tuple[Tensor, Tensor]] | None,
    ) -> ModelOutput:
        """Path 1 after a prefix whose keys and values ``past`` holds (one (K, V) [B, KV, P, hd] per layer,
        constant: no gradient reaches them). The tokens sit at positions P.. P + T - 1; ``kv`` of the output
        holds their own keys and values per layer (detached)."""
        b, t = input_ids.shape
        if past is not None and len(past) != len(self.blocks):
            raise ValueError(f"past holds {len(past)} layers of keys and values; the model has {len(self.blocks)}")
        p0 = 0 if past is None else int(past[0][0].shape[2])
        pos = p0 + torch.arange(t, device=input_ids.device)[None, :].expand(b, t)
        rope = rotary_angles(pos, self.cfg.head_dim, self.cfg.rope_theta)
        h = self.embed(input_ids)
        chosen, free, rlog, kv = [], [], [], []
        ckpt = checkpoint_blocks and torch.is_grad_enabled()
        for i, blk in enumerate(cast("list[Block]", self.blocks)):
            rp = None if replay is None else replay[:, :, i]
            pkv = None if past is None else past[i]
            if ckpt:
                h, c, f, lg, k, v = checkpoint(blk, h, rope, None, rp, pkv, True, use_reentrant=False)
            else:
                h, c, f, lg, k, v = blk(h, rope, None, rp, pkv, True)
            chosen.append(c)
            free.append(f)
            rlog.append(lg.float())
            kv.append((k.detach(), v.detach()))
        return self._output(h, chosen, free, rlog, logits, kv)

    def _output(
        self,
        h: Tensor,
        chosen: list[Tensor],
        free: list[Tensor],
        rlog: list[Tensor],
        logits: bool,
        kv: list[tuple[Tensor, Tensor]] | None = None,
    ) -> ModelOutput:
        """The training path's output from the last block's hidden states and each layer's routing."""
        h = self.norm(h)
        return ModelOutput(
            logits=self.lm_head(h) if logits else None,
            values=self.value_head(h).squeeze(-1).float(),
            routing=torch.stack(chosen, dim=2),
            free_topk=torch.stack(free, dim=2),
            router_logits=torch.stack(rlog, dim=2),
            hidden=h,
            kv=kv,
        )

    def token_logprobs(
        self, hidden: Tensor, tokens: Tensor, *, with_entropy: bool = False, chunk: int | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``ppo.token_logprobs(lm_head(hidden), tokens)`` without the [B, T, V] logits: log-prob of
        ``tokens[:, p]`` under the logits at ``p - 1`` (0 at p = 0), and the entropy there if asked, float32
        [B, T]. The head runs over ``chunk`` positions at a time (tokens in all rows; default
        ``logprob_chunk(V)``, ``LOGPROB_BYTES`` of fp32 logits); under autograd each chunk is checkpointed, so
        the backward pass recomputes one chunk's logits at a time."""
        b, t = tokens.shape
        step = max(1, (chunk or logprob_chunk(self.cfg.vocab_size)) // max(b, 1))
        lp_parts, ent_parts = [], []
        grad = torch.is_grad_enabled() and (hidden.requires_grad or self.lm_head.weight.requires_grad)
        for lo in range(0, t - 1, step):
            hi = min(t - 1, lo + step)
            args = (hidden[:, lo:hi], tokens[:, lo + 1 : hi + 1], self.lm_head.weight, with_entropy)
            lp, ent = checkpoint(_head_logprobs, *args, use_reentrant=False) if grad else _head_logprobs(*args)
            lp_parts.append(lp)
            ent_parts.append(ent)
        pad = torch.zeros(b, 1, dtype=torch.float32, device=hidden.device)
        lp = torch.cat([pad, *lp_parts], dim=1)
        return lp, (torch.cat([pad, *ent_parts], dim=1) if with_entropy else None)

    def forward_cached(
        self,
        input_ids: Tensor,
        cache,
        slot0: int,
        start: Tensor,
        logits_at: Tensor | None = None,
        replay: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Incremental forward over cache slots [slot0, slot0 + B). Returns (logits [B, n, V], topk [B, n, L, K]);
        with ``logits_at`` [B] (an index into n per row) logits are [B, 1, V] at those tokens only (prefill).
        ``replay`` [B, n, L, K] forces each MoE layer's experts where it holds them (-1: the router's own),
        gated as R3 replay gates them: how a retracted sequence's context is recomputed under new weights with
        the routes it had used (scheduler.py)."""
        b, n = input_ids.shape
        dev = input_ids.device
        pos = start[:, None] + torch.arange(n, device=dev)[None, :]  # [B, n]
        rope = rotary_angles(pos, self.cfg.head_dim, self.cfg.rope_theta)
        fresh = n > 1 and not bool(start.any())  # a prefill from position 0 in every row: causal attention
        bias = None if fresh else attention_bias(pos, self.cfg.n_heads, self.embed.weight.dtype)
        h = self.embed(input_ids)
        topk = []
        last = len(self.blocks) - 1
        for i, blk in enumerate(cast("list[Block]", self.blocks)):  # a ModuleList of Blocks (see __init__)
            kc, vc = cache.layer(i, slot0, b)
            h = h + blk.attn.forward_cached(blk.attn_norm(h), pos, rope, kc, vc, bias)
            if replay is not None:
                out, c = blk.moe(blk.moe_norm(h).reshape(b * n, -1), replay[:, :, i].reshape(b * n, -1))[:2]
                h = h + out.view(h.shape)
            elif i == last and logits_at is not None and n > 1:
                # only the logits_at tokens' last-layer outputs are used: route every token (the routing is
                # recorded) but run the experts for those alone
                keep = torch.arange(b, device=dev) * n + logits_at
                out, c = blk.moe.infer(blk.moe_norm(h).reshape(b * n, -1), keep)
                h = (h.reshape(b * n, -1)[keep] + out)[:, None]
                logits_at = None
            else:
                out, c = blk.moe.infer(blk.moe_norm(h).reshape(b * n, -1))
                h = h + out.view(h.shape)
            topk.append(c.view(b, n, -1))
        if logits_at is not None:
            h = h[torch.arange(b, device=dev), logits_at][:, None]
        return self.lm_head(self.norm(h)), torch.stack(topk, dim=2)
