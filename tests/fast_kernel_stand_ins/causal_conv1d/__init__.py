"""Stand-in for Dao-AILab's `causal_conv1d_fn` / `causal_conv1d_update` (same keywords, `seq_idx` included)."""

from kernel_calls import record, torch_reference


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    record("causal_conv1d_fn", x.shape[0], x.shape[-1], {"seq_idx": seq_idx})
    if seq_idx is not None or initial_states is not None:
        raise NotImplementedError("the stand-in computes whole rows from zero state only")
    return torch_reference("transformers.models.qwen3_5.modeling_qwen3_5", "causal_conv1d_fn")(
        x, weight, bias, activation=activation)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None):
    raise NotImplementedError("single-token decoding is not part of a packed training forward")
