"""Prompt formats. ChatML is the bundled model's; field report 4 is what a wrongly applied one costs."""

from __future__ import annotations

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str, system: str | None = SMOLLM2_SYSTEM) -> str:
    """One user turn in ChatML, ending where the assistant's answer begins.

    The form field report 4 gives: `<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n`. Encode it with special tokens enabled so the tags become single tokens.
    """
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
