"""A stand-in for vLLM's OpenAI server, on the path of tests that drive the engine's protocol where real
vLLM cannot follow (sleep mode needs CUDA): the routes VLLMEngine calls, each request appended to the
JSON-lines file FAKE_VLLM_CALLS names. Completions are the prompt's last token repeated, log-prob -1,
answered after FAKE_VLLM_DELAY_S seconds."""

import argparse
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer({})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        url = urlsplit(self.path)
        with open(os.environ["FAKE_VLLM_CALLS"], "a") as f:
            f.write(json.dumps({"path": url.path, "query": url.query, "model": body.get("model"),
                                "lora_name": body.get("lora_name")}) + "\n")
        if url.path == "/v1/completions":
            time.sleep(float(os.environ.get("FAKE_VLLM_DELAY_S", "0")))  # a request in flight for a while
            n = body["max_tokens"]
            self._answer({"choices": [{"token_ids": [body["prompt"][-1]] * n,
                                       "logprobs": {"token_logprobs": [-1.0] * n}}]})
        else:
            self._answer({})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int)
    args, _ = p.parse_known_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
