"""TRL's trainers, packed: `sft` (`PackedSFTTrainer`), `dpo` (`PackedDPOTrainer`), `grpo` (`PackedGRPOTrainer`) and
`reward` (`PackedRewardTrainer`); `image_text` readies TRL's vision datasets for `PackedSFTTrainer`. Each keeps
TRL's loop, loss and logs, and changes only what packing needs.

May import: `llm_packing.batches`, `llm_packing.hook`, `llm_packing.data`, `llm_packing.core`, `llm_packing.errors`,
and TRL.
"""
