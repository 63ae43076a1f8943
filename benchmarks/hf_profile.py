"""Where a patched Llama's compiled decoding spends host time, beside the unpatched one.

    python -m benchmarks.hf_profile        # on a GPU

The model of :mod:`benchmarks.hf_generate` (8 layers, hidden 1024, bf16, random weights), compiled
with Inductor (``model.forward = torch.compile(model.forward)``), static cache, ``generate`` of
8 x (256 + 16) tokens, unpatched, RoPE alone and RoPE with the norms (``hf_generate.MODELS["llama"]``);
after two warm-up runs each model runs once timed and once under
``torch.profiler`` (CPU activity), and the ops with the most self CPU time are printed. On the H200
this showed ``tileops::apply`` at 112 us of host time per call (benchmarks/NOTES.md).
"""

from __future__ import annotations

import sys
import time

import torch

from .hf_generate import build_models, sizes


def main() -> int:
    if not torch.cuda.is_available():
        print("hf_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    size = dict(sizes("llama", quick=False), new=16)
    dev = torch.device("cuda")
    models = build_models("llama", size, dev, torch.bfloat16)
    prompt = torch.randint(3, size["vocab"], (size["batch"], size["prompt"])).to(dev)
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=16, min_new_tokens=16, do_sample=False,
              pad_token_id=0, cache_implementation="static", disable_compile=True)
    for m in models.values():
        m.forward = torch.compile(m.forward)
    with torch.no_grad():
        for m in models.values():
            m.generate(prompt, **kw)
            m.generate(prompt, **kw)
        for name, m in models.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m.generate(prompt, **kw)
            torch.cuda.synchronize()
            print(f"{name}: generate 8 x (256 + 16) {(time.perf_counter() - t0) * 1e3:.1f} ms")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                m.generate(prompt, **kw)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
