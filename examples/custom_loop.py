"""A plain PyTorch training loop on packed documents: no Trainer, just the collator and the model hook.

    python examples/custom_loop.py [--steps 20]

Outside `Trainer`, nothing turns the KV cache off: pass `use_cache=False` (a packed forward with a cache is refused,
as the cache would mix the documents).
"""

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig

from llm_packing import DataCollatorWithPacking, configure_packing, pack_dataset, verify_packing
from llm_packing.cli.documents import load_demo_documents


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
steps = parser.parse_args().steps
torch.manual_seed(0)

rows = pack_dataset(load_demo_documents(max_samples=100), max_length=512, overflow="split", seed=0)
loader = DataLoader(rows, batch_size=2, shuffle=True, collate_fn=DataCollatorWithPacking(max_length=512))

config = LlamaConfig(vocab_size=32_000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
configure_packing(model)
print(f"isolation verified: max abs logit difference {verify_packing(model):.2g}")

optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model.train()
step = 0
while step < steps:
    for batch in loader:
        # Mean over the batch's trained tokens: the same loss as training each document alone.
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        print(f"step {step}: loss {loss.item():.4f}, {int((batch['labels'] != -100).sum())} trained tokens")
        if step == steps:
            break
