"""The server side of Tinker SDK 0.38's binary wire format, on the SDK's own definitions.

The SDK sends ``forward_backward`` (and forward-only) requests as the protobuf
``ForwardBackwardRequest`` and asks for ``SampleResponse`` and ``ForwardBackwardOutput`` results
as protobuf (``Accept: application/x-protobuf``); everything else is JSON of ``tinker.types``
models. This module is the inverse of the SDK's ``tinker.proto.request_conv`` /
``response_conv``: it decodes requests into ``tinker.types.Datum`` and encodes results with the
bundled ``tinker_public_pb2`` messages, so a response decodes exactly as the service's would.

Imports the Tinker SDK (and numpy) at import time: only the local server imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import _tensor_data_from_proto  # the SDK's own Tensor decoder

__all__ = ["PROTO", "ForwardBackwardCall", "decode_forward_backward", "encode_forward_backward", "encode_sample"]

PROTO = "application/x-protobuf"
#: Empty cells of a top-k matrix (``tinker.types.topk_logprobs.MASK_LOGPROB``).
MASK_LOGPROB = -99999.0


@dataclass
class ForwardBackwardCall:
    """A decoded ``/api/v1/forward_backward`` request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, Any] | None
    forward_only: bool
    data: list[Any]  # tinker.types.Datum


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """The request as ``tinker.types`` values (``loss_fn_config_v2`` preferred, as the service does)."""
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    config: dict[str, Any] = {
        k: v.text if v.WhichOneof("value") == "text" else v.number for k, v in msg.loss_fn_config_v2.items()
    }
    if not config:
        config = dict(msg.loss_fn_config.items())
    data = []
    for datum in msg.data:
        chunks: list[types.ModelInputChunk] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise ValueError(f"this server takes token chunks only, got {chunk.WhichOneof('chunk')!r}")
            tokens = np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
            chunks.append(types.EncodedTextChunk(tokens=tokens))
        inputs = {name: _tensor_data_from_proto(tensor) for name, tensor in datum.loss_fn_inputs.items()}
        spans = (_spans(datum.model_input_spans), _spans(datum.loss_fn_input_spans))
        if (spans[0] is None) != (spans[1] is None):
            raise ValueError(
                "provenance comes as a pair: a datum has model_input_spans or loss_fn_input_spans, not both"
            )
        data.append(
            types.Datum(
                model_input=types.ModelInput(chunks=chunks),
                loss_fn_inputs=inputs,
                model_input_spans=spans[0],
                loss_fn_input_spans=spans[1],
            )
        )
    return ForwardBackwardCall(msg.model_id, int(msg.seq_id), msg.loss_fn, config or None, bool(msg.forward_only), data)


def _spans(msgs: Any) -> list[Any] | None:
    """A datum's provenance runs (``Datum.with_provenance``), or None when it has none."""
    out: list[Any] = []
    for msg in msgs:
        arm = msg.WhichOneof("span")
        cls = types.SampledProvenanceSpan if arm == "sampled_tokens" else types.PromptProvenanceSpan
        run = getattr(msg, arm or "prompt_tokens")
        out.append(cls(sequence_id=run.sequence_id, offset=int(run.offset), length=int(run.length)))
    return out or None


def encode_forward_backward(outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one ``ArrayRecord`` batching every datum's output arrays
    (float32; rows of ``(N,)`` or ``(N, K)``), plus the metrics."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        field = record.fields[name]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
        field.dtype = pb.DTYPE_FLOAT32
        field.trailing_shape.extend(list(arrays[0].shape[1:]))
    return msg.SerializeToString()


def _topk(rows: Sequence[Sequence[tuple[int, float]] | None], k: int) -> Any:
    """Dense ``N x k`` top-k matrices (``TopkLogprobs``), masked where a row has fewer (or none)."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate(list(row or [])[:k]):
            ids[i, j], lps[i, j] = int(token), float(lp)
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def encode_sample(
    sequences: Sequence[tuple[Sequence[int], Sequence[float], str]],
    prompt_logprobs: Sequence[float | None] | None = None,
    topk_prompt: Sequence[Sequence[tuple[int, float]] | None] | None = None,
    k: int = 0,
    topk_sampled: Sequence[Sequence[Sequence[tuple[int, float]]]] | None = None,
    k_sampled: int = 0,
) -> bytes:
    """A ``SampleResponse``: ``(tokens, logprobs, stop_reason)`` per sequence (and, with
    ``k_sampled``, each sampled position's top-k); prompt logprobs with NaN where there is none
    (position 0, or before ``prompt_logprobs_last_n``); top-k prompt logprobs as dense ``N x k``
    matrices with masked cells."""
    msg = pb.SampleResponse()
    for i, (tokens, logprobs, reason) in enumerate(sequences):
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(list(tokens), dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(list(logprobs), dtype=np.float32).tobytes()
        if topk_sampled is not None and k_sampled > 0 and len(tokens):
            seq.topk_sampled_logprobs.CopyFrom(_topk(topk_sampled[i], k_sampled))
    if prompt_logprobs is not None:
        values = [float("nan") if v is None else float(v) for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if topk_prompt is not None and k > 0:
        msg.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt, k))
    return msg.SerializeToString()
