import torch

from tileops.rope import RoPEFwdOp

# Construct once: the constructor takes what the kernel is compiled with.
op = RoPEFwdOp(rope_layout="neox", input_layout="2d")

# Call on tensors: x is [batch, seq_len, num_heads, head_dim]. The first call picks the target
# from the device (no target was named), compiles a kernel for this dtype and head_dim, and runs it.
x = torch.randn(2, 128, 8, 64, dtype=torch.float32)
out = op(x)

print(op.serving_target, tuple(out.shape), out.dtype)

# Later calls with new lengths reuse the compiled kernel.
out = op(torch.randn(1, 1000, 8, 64))
