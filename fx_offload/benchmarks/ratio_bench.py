"""``python -m fx_offload ratio``: how far ``compress="lossless"`` shrinks trained weights, not
only normally drawn ones, without downloading a checkpoint.

The built-in decoder (``--layers``, ``--hidden``, ``--inner``; vocabulary 256) is trained
with AdamW (``--steps``, learning rate ``--lr``, weight decay 0.1) to predict the next token
of sequences drawn from a fixed random Markov chain of 256 states (each state goes to one of
8 successors), a task it learns (the loss printed falls from ln 256 = 5.5 towards ln 8 = 2.1).
Then, for the layers' weights cast to bf16, before and after training, and for weights drawn
normal(0, 0.02):

* ``ours``: the bytes of fx_offload's records (:mod:`fx_offload.codecs.lossless`) over the
  raw bytes, each weight one chunk;
* ``nvCOMP``: the same for nvCOMP's ANS records, where nvCOMP's library and a GPU are there;
* ``exponent bound``: (8 + H) / 16, H the entropy of the weights' exponents in bits: what a
  coder that codes the exponent ideally and keeps sign and mantissa as they are reaches
  (nvCOMP's ANS records measured 0.691 on normal(0, 0.02) weights of 8B shape, where this
  bound is 0.659).

Runs on the CPU in about a minute (2 cores); the numbers are ratios, not times.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from ..codecs import ans, lossless
from ..tools import models


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size")
    parser.add_argument("--inner", type=int, default=512, help="MLP intermediate size")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument("--seq", type=int, default=64, help="tokens per training sequence")
    parser.add_argument("--batch", type=int, default=16, help="sequences per training step")


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model = models.TinyDecoder(args.layers, hidden=args.hidden, inner=args.inner)
    before = _layer_weights(model)
    print(f"the built-in decoder, {args.layers} layers (hidden {args.hidden}, inner "
          f"{args.inner}), trained on the CPU for {args.steps} steps; torch {torch.__version__}",
          flush=True)
    _train(model, args)
    after = _layer_weights(model)
    drawn = [torch.randn(w.shape).mul_(0.02).bfloat16() for w in after]
    gpu = torch.device("cuda") if torch.cuda.is_available() else None
    with_nvcomp = gpu is not None and ans.available(gpu)
    print(f"\n{'weights (bf16)':36s} {'ours':>6s} {'nvCOMP':>7s} {'exponent bound':>15s}")
    for name, weights in (("drawn normal(0, 0.02)", drawn), ("initial (torch's init)", before),
                          (f"trained, {args.steps} steps", after)):
        ours = _ratio(weights, lambda raw: lossless.encode(raw, gpu))
        nv = _ratio(weights, lambda raw: ans.encode(raw, gpu)) if with_nvcomp else None
        print(f"{name:36s} {ours:6.3f} {'-' if nv is None else f'{nv:.3f}':>7s} "
              f"{_exponent_bound(weights):15.3f}")
    if not with_nvcomp:
        print("(nvCOMP: needs a GPU and nvCOMP's library, pip install nvidia-libnvcomp-cu13)")
    return 0


def _train(model, args) -> None:
    gen = torch.Generator().manual_seed(1)
    successors = torch.randint(0, 256, (256, 8), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    for step in range(args.steps):
        tokens = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, 256, (args.batch,), generator=gen)
        for t in range(args.seq):
            pick = torch.randint(0, 8, (args.batch,), generator=gen)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"  step {step:4d}: loss {loss.item():.3f}", flush=True)


def _layer_weights(model) -> list[torch.Tensor]:
    """The layers' matrices (what offloading moves, norms aside) as bf16 copies."""
    return [p.detach().bfloat16().clone() for layer in model.layers
            for p in layer.parameters() if p.dim() == 2]


def _ratio(weights, encode) -> float:
    raw = packed = 0
    for w in weights:
        made = encode(w.reshape(-1).view(torch.uint8))
        raw += w.numel() * 2
        packed += w.numel() * 2 if made is None else made[1].nbytes
    return packed / raw


def _exponent_bound(weights) -> float:
    exps = torch.cat([(w.reshape(-1).view(torch.int16) >> 7 & 0xFF).long() for w in weights])
    p = torch.bincount(exps, minlength=256).double() / exps.numel()
    entropy = -sum(float(q) * math.log2(float(q)) for q in p if q > 0)
    return (8 + entropy) / 16
