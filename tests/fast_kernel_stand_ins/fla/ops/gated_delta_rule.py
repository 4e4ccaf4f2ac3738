"""Stand-in for flash-linear-attention's `chunk_gated_delta_rule` (same keywords, `cu_seqlens` included)."""

from kernel_calls import record, torch_reference


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    record("chunk_gated_delta_rule", q.shape[0], q.shape[1], {"cu_seqlens": cu_seqlens})
    if cu_seqlens is not None:
        raise NotImplementedError("the stand-in computes whole rows only; the test expects no cu_seqlens")
    reference = torch_reference("transformers.models.qwen3_5.modeling_qwen3_5", "torch_chunk_gated_delta_rule")
    return reference(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
