"""A plain PyTorch loop with each packed row cut across 2 processes (Ulysses sequence parallelism), on CPU.

    python examples/sequence_parallel_loop.py [--steps 10]

It starts its 2 processes itself (gloo on 127.0.0.1); under `torchrun --nproc_per_node 2` the same `train` function
runs once per process. Both processes read the same batches, each trains its half of every row, and the gradients are
summed over the pair: together, one step on the whole rows, each document attending only to itself.
"""

import argparse
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig

from llm_packing import DataCollatorWithPacking, configure_sequence_parallel, pack_dataset, shard_packed_batch
from llm_packing.cli.documents import load_demo_documents
from llm_packing.parallel import sequence_parallel_group, sum_gradients, verify_sequence_parallel


SIZE = 2


def train(rank: int, port: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    torch.manual_seed(0)  # the same model and the same batch order on both processes
    rows = pack_dataset(load_demo_documents(max_samples=100), max_length=512, overflow="split", seed=0)
    loader = DataLoader(rows, batch_size=2, shuffle=True, collate_fn=DataCollatorWithPacking(max_length=512),
                        generator=torch.Generator().manual_seed(0))
    config = LlamaConfig(vocab_size=32_000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    group = sequence_parallel_group(SIZE)
    configure_sequence_parallel(model, SIZE, group=group)
    difference = verify_sequence_parallel(model, group)
    if rank == 0:
        print(f"isolation verified across {SIZE} processes: max abs logit difference {difference:.2g}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step, batch in zip(range(1, steps + 1), loader, strict=False):
        piece = shard_packed_batch(batch, rank=dist.get_rank(group), world_size=SIZE)
        # This process's tokens' losses over the whole batch's targets: the pair's losses add up to the mean.
        loss = model(**piece, use_cache=False).loss
        loss.backward()
        sum_gradients(model, group)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss, group=group)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}, {piece['input_ids'].shape[1]} of "
                  f"{piece['attention_mask'].shape[1]} tokens a row on each process")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    mp.spawn(train, args=(free_port, parser.parse_args().steps), nprocs=SIZE, join=True)
