"""TRL's SFTTrainer on packed documents: tokenize, `pack_dataset`, `PackedSFTTrainer`. CPU, nothing downloaded.

    python examples/sft_trainer.py [--max_steps 20]
"""

import argparse
import logging

from transformers import AutoModelForCausalLM, LlamaConfig
from trl import SFTConfig

from llm_packing import PackedSFTTrainer, pack_dataset
from llm_packing.cli.documents import load_demo_documents
from llm_packing.demo.chitchat import load_demo_tokenizer


parser = argparse.ArgumentParser()
parser.add_argument("--max_steps", type=int, default=20)
max_steps = parser.parse_args().max_steps
logging.basicConfig(format="%(name)s: %(message)s")
logging.getLogger("llm_packing").setLevel(logging.INFO)  # the packing stats, and whether isolation was verified

documents = load_demo_documents(max_samples=100)  # real chats, Mistral tokenizer; labels -100 on user turns
train_dataset = pack_dataset(documents, max_length=512, overflow="split")
tokenizer = load_demo_tokenizer()
config = LlamaConfig(vocab_size=32_000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                     pad_token_id=tokenizer.pad_token_id)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

# The design card's line: TRL's trainer, its config and defaults; rows are never cut, documents never mixed.
args = SFTConfig(output_dir="outputs/example-sft", max_steps=max_steps, per_device_train_batch_size=2,
                 learning_rate=3e-3, logging_steps=max(1, max_steps // 4), report_to="none", save_strategy="no",
                 use_cpu=True, bf16=False, activation_checkpointing=False)
trainer = PackedSFTTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer)
result = trainer.train()
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
print(f"{result.global_step} steps: last logged loss {losses[-1]:.4f}, mean loss over the run "
      f"{result.training_loss:.4f}")
