"""Batch builders: `collator` (`DataCollatorWithPacking`, packed rows to the batch the hook expects),
`image_text` (`pack_image_text_documents`, per-document processor outputs of image-text conversations to a packed
batch), `packed_conversations` (image-text rows through the processor, one document at a time, for the collator) and
`padded_forward` (the real tokens of a trainer's padded batch run packed, outputs scattered back).

May import: `llm_packing.core`, `llm_packing.hook`, `llm_packing.errors`, and `llm_packing.data.video` (a video's
header, the frames its video processor samples, their decoding: the collator decodes the frames `pack_dataset` planned
by).
"""
