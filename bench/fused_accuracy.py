"""How far the fused and the unfused full-FP8 draft views are from the same draft in fp32 on
the GPU (the test model of tests/test_gpu_engine.py), per kernel choice: "timed" (each shape's
timed choice), "rows" (fp32 products everywhere), "rows16" (FP16 products where the weights
are FP8). Also the fused view run in fp32 against the unfused one in fp32 (the kernels' own
error, rounding placement aside). Prints mean/max relative error and argmax agreement."""

import copy

import torch

import unimax.ops.fused_gemv as fused_gemv
import unimax.ops.gemv as gemv
from unimax import GDNConfig, GDNForCausalLM
from unimax.fast_step import gemv_view
from unimax.fp8 import quantize_view

CONFIG = GDNConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_k_heads=2,
                   num_v_heads=4, head_k_dim=64, head_v_dim=64, intermediate_size=512)


def run(views, tokens):
    caches = [v.make_recurrent_cache() for v in views]
    out = [[] for _ in views]
    with torch.inference_mode():
        for i in range(tokens.shape[1]):
            for j, (v, c) in enumerate(zip(views, caches, strict=True)):
                out[j].append(v(input_ids=tokens[:, i: i + 1], past_key_values=c,
                                use_cache=True).logits.float()[0, -1])
    return [torch.stack(o) for o in out]


def report(name, a, ref):
    err = (a - ref).norm(dim=-1) / ref.norm(dim=-1)
    agree = (a.argmax(-1) == ref.argmax(-1)).float().mean()
    print(f"{name:34s} mean {err.mean():.4f} max {err.max():.4f} argmax agree {agree:.2f}")


def main():
    model = GDNForCausalLM.random(CONFIG, device="cuda", dtype=torch.bfloat16, seed=2)
    model32 = copy.deepcopy(model).float()
    gen = torch.Generator(device="cuda").manual_seed(5)
    tokens = torch.randint(0, CONFIG.vocab_size, (1, 40), device="cuda", generator=gen)
    d16, d32 = quantize_view(model, "full"), quantize_view(model32, "full")
    views = [gemv_view(d16, fuse=True), gemv_view(d16, fuse=False),
             gemv_view(d32, fuse=True), gemv_view(d32, fuse=False)]
    names = ["bf16 fused", "bf16 plain", "fp32 fused"]
    run(views, tokens[:, :2])  # (each shape's timed choice)
    for force in ("timed", "rows", "rows16"):
        if force != "timed":
            for table in (gemv.CHOICES, fused_gemv.CHOICES):
                for key in table:
                    scaled = key[-1] == torch.float8_e4m3fn
                    table[key] = force if scaled or force == "rows" else table[key]
        print(f"-- {force}: fused {sorted(set(fused_gemv.CHOICES.values()))} "
              f"plain {sorted(set(gemv.CHOICES.values()))}")
        outs = run(views, tokens)
        for name, out in zip(names, outs, strict=False):
            report(f"{force} {name} vs fp32 plain", out, outs[3])
        report(f"{force} bf16 fused vs bf16 plain", outs[0], outs[1])


if __name__ == "__main__":
    main()
