"""The trainer's optimizer: fused AdamW where torch has it (CPU and CUDA), the same update as foreach."""

from __future__ import annotations

import torch

from t1async.learner.trainer import Trainer
from t1async.model.config import MoEConfig
from t1async.model.moe import MoETransformer


def test_the_trainer_steps_with_fused_adamw_on_cpu():
    model = MoETransformer(MoEConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_experts=2, top_k=1, d_ff=16))
    opt = Trainer(model).optimizer
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True


def test_fused_adamw_takes_foreach_s_steps():
    """The default changed from foreach to fused: the same parameters after 20 steps, to fp32 rounding."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(33, 17, generator=gen), torch.randn(5, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(20)]
    after = []
    for kw in ({"foreach": True}, {"fused": True}):
        params = [p.clone().requires_grad_() for p in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, **kw)
        for g in grads:
            for p, gp in zip(params, g):
                p.grad = gp.clone()
            opt.step()
        after.append(params)
    for a, b in zip(*after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
