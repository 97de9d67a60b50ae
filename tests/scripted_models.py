"""Tiny models whose greedy output is a script chosen by the test: deterministic text end to end (a
reasoning model's thinking, a tool call), where a random-weight model's output is arbitrary.

`make_scripted_model(dir, script, template)`: each token of the script is followed by the next one, and any
other token by the script's first, so any prompt starts the script and a prompt that ends in a script token
goes on from there. The pieces of the script are tokens of their own, added to the tiny byte-level
tokenizer (`tests/tiny_models.py`) as ordinary, not special, tokens; the script ends with the end-of-turn
token `<|im_end|>`.

How: every layer's output projections (o_proj, down_proj) are zero, so the residual stream is the token's
embedding; the embedding of token t is the one-hot vector of t (the hidden size is the vocabulary's, rounded
up to whole 64-wide heads), which the final norm keeps one-hot (times sqrt(hidden)), and the head scores
only t's successor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_models import _BASE_SHAPE, _hf_classes, _write_tokenizer

# Chat templates of the two reasoning families, cut to what the tests need. Qwen3's: the model opens its
# thinking itself, and `enable_thinking: false` writes an empty thinking into the prompt (Qwen3's own
# writes blanks after it, which the parser allows; here the prompt ends at `</think>`, so that the script
# goes on from it to the answer). The tools are rendered in Qwen3's words.
QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}"
    "</tools>\nReply with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>' }}{%- endif %}"
    "{%- endif %}"
)
# DeepSeek-R1's: the generation prompt opens the thinking.
DEEPSEEK_R1_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- else %}{{ '<｜Assistant｜>' + message['content'] + '<|im_end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>' }}{%- endif %}"
)


def make_scripted_model(directory: str | Path, script: list[str], chat_template: str) -> Path:
    """Writes the model directory (see the module's text); the script must not repeat a piece."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(script)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    ids = [tokenizer.convert_tokens_to_ids(piece) for piece in script] + [tokenizer.eos_token_id]
    if len(set(ids)) != len(ids):
        raise ValueError("a scripted model's script must not repeat a piece: each token has one successor")
    hidden = -(-len(tokenizer) // 64) * 64
    config_cls, model_cls = _hf_classes("llama")
    config = config_cls(**{**_BASE_SHAPE, "vocab_size": hidden, "hidden_size": hidden,
                           "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64,
                           "eos_token_id": tokenizer.eos_token_id})
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    successor = torch.full((hidden,), ids[0])
    successor[ids[:-1]] = torch.tensor(ids[1:])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(hidden))
        model.lm_head.weight.zero_()
        model.lm_head.weight[successor, torch.arange(hidden)] = 1.0
    model.save_pretrained(directory, safe_serialization=True)
    return directory
