"""A composed op is the ops its manifest's ``compose:`` names, in one kernel: runs on the CPU as written.

The attention prologue composes ``norm/RMSNormFwdOp`` (with ``qk_norm``) and any op of the ``rope``
family (its ``rope`` param). Its kernel spec holds the spec of each stage's own kernel, and its q
and key cache are what those ops give run one after the other.
"""

import torch

from tileops.attention import AttnPrologueFwdOp
from tileops.attention.builtin import kernel_specs
from tileops.manifest import CallSpec
from tileops.norm import RMSNormFwdOp
from tileops.rope import YaRNFwdOp

device = "cuda" if torch.cuda.is_available() else "cpu"
hq, hkv, d, tokens = 4, 2, 64, 5
rope = YaRNFwdOp("2d", scale=4.0, original_max_position=4096, rope_layout="interleaved")  # DeepSeek's pairing
op = AttnPrologueFwdOp(hq, hkv, d, rope, qk_norm=True)

# 1. the fused kernel's spec: the rope op's and the norm op's own specs, and the cache write's fields
call = CallSpec(torch.device(device), (("qkv", "bfloat16"), ("positions", "int64"), ("slot_mapping", "int64")),
                (("width", (hq + 2 * hkv) * d),))
[(builder, spec)] = kernel_specs(op.manifest, op.params, call, "cuda" if device == "cuda" else "c")
print(builder, "rope:", spec.rope.pairing, spec.rope.rot, "norm:", spec.norm.rounding, "heads:", spec.hq, spec.hkv)

# 2. the fused op against the chain of the ops it composes
gen = torch.Generator().manual_seed(0)
qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16).to(device)
positions = torch.tensor([0, 1, 2, 700, 4095], device=device)
slots = torch.tensor([3, 0, -1, 9, 4], device=device)  # -1: padding, no cache write
qw, kw = (1 + 0.3 * torch.randn(2, d, generator=gen)).to(torch.bfloat16).to(device)
key_cache, value_cache = (torch.zeros(2, 8, hkv, d, dtype=torch.bfloat16, device=device) for _ in range(2))
q = op(qkv, positions, key_cache, value_cache, slots, q_norm_weight=qw, k_norm_weight=kw)

heads = qkv.view(1, tokens, hq + 2 * hkv, d)  # [batch, seq, heads, head_dim], the rope op's 2d layout
norm = RMSNormFwdOp()  # the op compose.norm names, with the prologue's eps (its default, 1e-6)
q_normed, k_normed = norm(heads[..., :hq, :], qw), norm(heads[..., hq:hq + hkv, :], kw)
q_chain, k_chain = (t[0] for t in rope(q_normed, position_ids=positions, key=k_normed))
written = slots >= 0
print("q:", torch.equal(q, q_chain), "k:", torch.equal(key_cache.view(-1, hkv, d)[slots[written]], k_chain[written]))
