"""TRL's SFTTrainer on packed documents: tokenize, `pack_dataset`, `configure_packing`, train. CPU, nothing downloaded.

    python examples/sft_trainer.py [--max_steps 20]
"""

import argparse

from transformers import AutoModelForCausalLM, LlamaConfig
from trl import SFTConfig, SFTTrainer

from llm_packing import DataCollatorWithPacking, configure_packing, pack_dataset
from llm_packing.demo_data import load_demo_tokenizer
from llm_packing.documents import load_demo_documents


parser = argparse.ArgumentParser()
parser.add_argument("--max_steps", type=int, default=20)
max_steps = parser.parse_args().max_steps

documents = load_demo_documents(max_samples=100)  # real chats, Mistral tokenizer; labels -100 on user turns
train_dataset = pack_dataset(documents, max_length=512, overflow="split")
config = LlamaConfig(vocab_size=32_000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
configure_packing(model)  # indexed masks -> per-document attention; raises if the model cannot be isolated

args = SFTConfig(output_dir="outputs/example-sft", max_steps=max_steps, per_device_train_batch_size=2,
                 learning_rate=3e-3, logging_steps=5, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
                 dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=load_demo_tokenizer(),
                     data_collator=DataCollatorWithPacking(max_length=512))
print(trainer.train())
