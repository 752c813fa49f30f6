"""An OpenAI-compatible server (TabbyAPI, vLLM, SGLang, llama.cpp, `transformers serve`) as an exlnb engine.

`client.py` speaks HTTP and server-sent events, `request.py` turns a `JobSpec` into a request body in the
server's dialect, `prompt.py` keeps the chat messages behind a rendered prompt, `metrics.py` reads the server's
Prometheus `/metrics`, and `engine.py` is the `Engine` over them. Nothing here imports torch.
"""
