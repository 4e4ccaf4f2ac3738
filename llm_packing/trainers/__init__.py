"""TRL's trainers, packed: `sft` (`PackedSFTTrainer`; `sft_data` turns the datasets `SFTTrainer` takes into packed
rows, `sft_checks` is what its constructor checks, `image_text` readies TRL's vision datasets for it), `dpo`
(`PackedDPOTrainer`), `grpo` (`PackedGRPOTrainer`) and `reward` (`PackedRewardTrainer`); `sequence_parallel` is what
`PackedSFTTrainer` changes for `sequence_parallel_size`, `token_counts` how it counts tokens for TRL's logs on indexed
masks, `neftune` its NEFTune noise per document. Each keeps TRL's loop, loss and logs, and changes only what packing
needs.

May import: `llm_packing.batches`, `llm_packing.hook`, `llm_packing.parallel`, `llm_packing.data`, `llm_packing.core`,
`llm_packing.errors`, and TRL.
"""
