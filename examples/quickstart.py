import torch
from transformers import GPT2Config, GPT2LMHeadModel

import memscale

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=8192,
                                   n_positions=128, bos_token_id=0, eos_token_id=0))
ids = torch.randint(0, 8192, (4, 128))
batch = {"input_ids": ids, "labels": ids}
optimizer = torch.optim.AdamW(model.parameters())

# A budget of 0.2 GiB of live tensors: this step needs about 0.23 GiB unoptimized.
# The plan is made inside the first forward, from its inputs, and applies to it.
memscale.wrap(model, memscale.Config(memory_budget_gb=0.2), optimizer=optimizer)
for step in range(3):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")
print(model._memscale_executor.plan.technique_counts)
memscale.detach(model)          # every hook gone; the model is as it was
