"""One greedy reply of a chat model to a fixed prompt: what `llm_packing.train` prints before and after fine-tuning
(`sample_prompt` in a recipe), so a run shows what training did to the model, not only a loss."""

import torch


def sample_reply(model, tokenizer, prompt: str, *, max_new_tokens: int = 40) -> str:
    """
    The model's greedy reply to `prompt` as a single user turn of the tokenizer's chat template (plain text without
    one). The model's training mode is restored.
    """
    if tokenizer.chat_template:
        input_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    else:
        input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    input_ids = input_ids.to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # Training configs turn the cache off; generating without it would redo every prefix.
            output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                    pad_token_id=tokenizer.pad_token_id)
    finally:
        model.train(was_training)
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True).strip()
