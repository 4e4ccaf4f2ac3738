"""Images and videos in packed batches, each kept with its own document:

- `multimodal`: media inputs guarded: the proven image-text types prepared by `image_text`, all others refused;
- `image_text`: a packed forward with images (backend and type checks, each image's document, mRoPE positions);
- `placeholders`: which document each image's or video's placeholder tokens lie in;
- `mrope`: per-document 3-D positions for the mRoPE families (temporal positions for videos);
- `video`: videos of the proven video types, their units and owners;
- `cross_attention`: Mllama's cross-attention to images bounded by the document;
- `verify_images`: `verify_packing`'s image (and video) document check.

May import: the hook's core modules (`registry`, `documents`, `masks`, `builders`, `guards`, `support`),
`llm_packing.errors`, torch and transformers; never `hook.configure`.
"""
