import torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
t = torch.tensor([0.8, 0.5, -1.0])
cu = torch.tensor([2, 5, 6], dtype=torch.int32)
for _ in range(3):
    print(expand_batch_to_tokens(t, cu, 6, replace_from=-1, replace_to=1))
print("int:", expand_batch_to_tokens(torch.tensor([3, 4, 5]), cu, 6))
