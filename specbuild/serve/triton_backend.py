"""The model of a `specbuild triton-repo` repository on Triton's Python backend (imported by its 1/model.py).

initialize() loads the engine named by config.pbtxt's parameters (engine_dir, threads, max_batch_size) and starts
its scheduler thread; execute() takes each request's inputs (triton_io.py), hands the request to the scheduler and
returns at once (decoupled): a thread per request sends one response per engine step that gave it tokens, the last
one flagged final; a refused request gets one error response naming the input. A request whose client cancelled it
leaves the batch at the next step. finalize() cancels what is still in flight. `triton_python_backend_utils` exists
only inside Triton: it is imported when Triton calls initialize().
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from specbuild.serve import triton_io
from specbuild.serve.errors import APIError
from specbuild.serve.state import ServerState

MAX_QUEUE = 64  # requests waiting for a KV slot beyond the slots; more are refused with an error response


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("config.pbtxt: specbuild streams: set model_transaction_policy "
                                                "{ decoupled: true }")  # fmt: skip
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        if "engine_dir" not in params:
            raise pb_utils.TritonModelException('config.pbtxt: parameters has no "engine_dir"')
        slots = int(params["max_batch_size"]) if params.get("max_batch_size") else None
        threads = int(params["threads"]) if params.get("threads") else None
        self.state = ServerState(
            Path(params["engine_dir"]), args["model_name"], dict(threads=threads), slots, MAX_QUEUE
        )
        if not self.state.load():
            raise pb_utils.TritonModelException(f"{params['engine_dir']}: the engine failed to load: "
                                                f"{self.state.failure}")  # fmt: skip

    def execute(self, requests):
        pb = self.pb
        for request in requests:
            arrays = {}
            for spec in triton_io.INPUTS:
                tensor = pb.get_input_tensor_by_name(request, spec.name)
                if tensor is not None:
                    arrays[spec.name] = tensor.as_numpy()
            sender = request.get_response_sender()
            threading.Thread(target=self._serve, args=(arrays, sender), name="specbuild-triton", daemon=True).start()
        return None

    def _serve(self, arrays: dict, sender) -> None:
        pb, state = self.pb, self.state
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            wanted = triton_io.parse_inputs(arrays, state.engine, state.model_name)
            handle = state.submit(wanted.request())
            responses = triton_io.Responses(state.engine, handle)
            for _ in handle:
                if _cancelled(sender):
                    handle.cancel()  # the request leaves the batch at the next step
                    continue
                sender.send(self._response(responses.step()))
            if _cancelled(sender):
                sender.send(flags=final)
            else:
                sender.send(self._response(responses.last()), flags=final)
        except Exception as exc:  # noqa: BLE001 - whatever fails ends this request with its error, not the model
            message = exc.message if isinstance(exc, APIError) else f"{type(exc).__name__}: {exc}"
            sender.send(pb.InferenceResponse(error=pb.TritonError(message)), flags=final)

    def _response(self, arrays: dict):
        pb = self.pb
        return pb.InferenceResponse(output_tensors=[pb.Tensor(name, value) for name, value in arrays.items()])

    def finalize(self) -> None:
        self.state.drain(grace_s=0)


def _cancelled(sender) -> bool:
    is_cancelled = getattr(sender, "is_cancelled", None)  # Python backend 23.10 and later
    return bool(is_cancelled and is_cancelled())
