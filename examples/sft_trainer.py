"""One import from TRL's `SFTTrainer`: the same script, dataset and config, packed. CPU, nothing downloaded.

    python examples/sft_trainer.py [--max_steps 20]

`PackedSFTTrainer` takes what `SFTTrainer` takes: here TRL's conversational format (a `messages` column) with
`assistant_only_loss=True`. TRL's own code applies the chat template and masks the user's turns; the documents are
then packed into rows of `max_length` tokens, each attending only to itself. Rows made by `pack_dataset` work too.
"""

import argparse
import logging

from transformers import AutoModelForCausalLM, LlamaConfig
from trl import SFTConfig

from llm_packing import PackedSFTTrainer  # was: from trl import SFTTrainer
from llm_packing.demo.chitchat import load_chitchat_dataset, load_demo_tokenizer


parser = argparse.ArgumentParser()
parser.add_argument("--max_steps", type=int, default=20)
max_steps = parser.parse_args().max_steps
logging.basicConfig(format="%(name)s: %(message)s")
logging.getLogger("llm_packing").setLevel(logging.INFO)  # the packing stats, and whether isolation was verified

dataset = load_chitchat_dataset(100)  # real two-speaker chats: {"messages": [{"role": "user", "content": ...}, ...]}
tokenizer = load_demo_tokenizer()  # Mistral-7B's, with a chat template that marks assistant turns ({% generation %})
config = LlamaConfig(vocab_size=32_000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                     pad_token_id=tokenizer.pad_token_id)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

# TRL's config and defaults (max_length 1024: the longer chats are truncated as SFTTrainer truncates them, and the
# log says how many tokens that cut; `PackedSFTTrainer(..., overflow="split")` keeps every token instead).
args = SFTConfig(output_dir="outputs/example-sft", assistant_only_loss=True, max_steps=max_steps,
                 per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=max(1, max_steps // 4),
                 report_to="none", save_strategy="no", use_cpu=True, bf16=False, activation_checkpointing=False)
trainer = PackedSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
result = trainer.train()
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
print(f"{result.global_step} steps: last logged loss {losses[-1]:.4f}, mean loss over the run "
      f"{result.training_loss:.4f}")
