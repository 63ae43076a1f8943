import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tileops.integrations.transformers import patch, report, unpatch
from tileops.rope import from_hf_config

# A tiny randomly initialised Llama with Llama 3.1 rope scaling: nothing is downloaded.
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64})
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
print(from_hf_config(config))  # the op that reproduces the config's rotary embedding

ids = torch.randint(3, 128, (2, 20))
mask = torch.ones_like(ids)
mask[1, :4] = 0  # left padding in the second row
want = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)

patch(model)  # q and k go through the RoPE op at the positions HF computed; the RMSNorms through RMSNormFwdOp
got = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
print("same tokens as transformers:", torch.equal(got, want))
print(report(model)["norm"])  # the routed norm modules: {'LlamaRMSNorm': 5}

loss = model(ids, labels=ids).loss
loss.backward()  # gradients flow through the ops to q_proj, k_proj and the norm weights
print("q_proj grad:", model.model.layers[0].self_attn.q_proj.weight.grad is not None)
print("norm weight grad:", model.model.norm.weight.grad is not None)

unpatch(model)  # the original functions and forwards are back
