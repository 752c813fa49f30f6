"""An OpenAI-compatible server (TabbyAPI, vLLM, SGLang, llama.cpp, `transformers serve`) as an exlnb engine.

`client.py` speaks HTTP, every read bounded; `answer.py` reads a streamed answer event by event within its size
limits; `chunk.py` checks each event's shape, the one place that does; `request.py` turns a `JobSpec` into a request
body in the server's dialect; `prompt.py` keeps the chat messages behind a rendered prompt; `job.py` turns a job's
chunks into events; `metrics.py` reads the server's Prometheus `/metrics`; and `engine.py` is the `Engine` over
them. Nothing here imports torch.
"""
