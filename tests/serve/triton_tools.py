"""Run in the Triton venv by tests/serve/test_triton.py (it has tritonclient and PyTriton, pinned to numpy < 2).

triton_tools.py grpc HOST:PORT MODEL MAX_TOKENS PROMPT...
    every prompt as one concurrent gRPC stream; prints [{"ids", "text", "finish_reason", "error"}] in order
triton_tools.py server REPOSITORY --port P --grpc-port G --metrics-port M
    the Triton server inside the PyTriton wheel on a model repository (set up as PyTriton sets it up: the Python
    backend stub of this interpreter's version, the wheel's libraries and this interpreter's LIBDIR on
    LD_LIBRARY_PATH); replaced by tritonserver (exec)
"""

from __future__ import annotations

import json
import os
import shutil
import site
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import numpy as np


def grpc(url: str, model: str, max_tokens: int, prompts: list[str]) -> list[dict]:
    import tritonclient.grpc as grpcclient

    results = [{"ids": [], "text": "", "finish_reason": None, "error": None} for _ in prompts]
    left, lock, finished = set(range(len(prompts))), threading.Lock(), threading.Event()

    def callback(result, error):
        if error is not None:  # an error names no request: the test sends only good ones here
            with lock:
                results[min(left)]["error"] = str(error)
                left.discard(min(left))
                if not left:
                    finished.set()
            return
        response = result.get_response()
        index = int(response.id)
        if response.outputs:
            results[index]["ids"] += [int(i) for i in result.as_numpy("output_ids")]
            results[index]["text"] += result.as_numpy("text_output")[0].decode()
            results[index]["finish_reason"] = result.as_numpy("finish_reason")[0].decode() or None
        if response.parameters["triton_final_response"].bool_param:
            with lock:
                left.discard(index)
                if not left:
                    finished.set()

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    for index, prompt in enumerate(prompts):
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        limit = grpcclient.InferInput("max_tokens", [1], "INT32")
        limit.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
        client.async_stream_infer(model, [text, limit], request_id=str(index), enable_empty_final_response=True)
    if not finished.wait(120):
        raise SystemExit(f"the streams did not finish: {results}")
    client.stop_stream()
    return results


def server(repository: str, args: list[str]) -> None:
    from pytriton.triton import TRITONSERVER_DIST_DIR
    from pytriton.utils.distribution import get_libs_path, get_stub_path

    ports = dict(zip(args[::2], args[1::2]))
    root = Path(tempfile.mkdtemp(prefix="tritonserver-"))
    shutil.copytree(TRITONSERVER_DIST_DIR, root / "tritonserver", ignore=shutil.ignore_patterns("python_backend_stubs"))
    backends = root / "tritonserver" / "backends"
    shutil.copy(get_stub_path(f"{sys.version_info[0]}.{sys.version_info[1]}"), backends / "python")
    paths = [str(get_libs_path()), sysconfig.get_config_var("LIBDIR"), os.environ.get("LD_LIBRARY_PATH", "")]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    # the stub embeds this Python: it imports the model's packages from this venv (and specbuild from PYTHONPATH)
    packages = [os.environ.get("PYTHONPATH", ""), *site.getsitepackages()]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in packages if p)
    binary = str(root / "tritonserver" / "bin" / "tritonserver")
    command = [binary, f"--model-repository={repository}", f"--backend-directory={backends}"]
    command += [f"--http-port={ports['--port']}", f"--grpc-port={ports['--grpc-port']}"]
    command += [f"--metrics-port={ports['--metrics-port']}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1"]
    os.execv(binary, command)


if __name__ == "__main__":
    if sys.argv[1] == "grpc":
        print(json.dumps(grpc(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])))
    elif sys.argv[1] == "server":
        server(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)
