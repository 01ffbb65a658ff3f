"""vdjax.text.prompt: chat rendering and the context/question boundary, also under
templates that trim the message."""

import pytest

from vdjax.eval.sample import Sample, render_ids, render_text
from vdjax.text.prompt import render_chat

from helpers import tiny_tokenizer

# Llama-3.x / Gemma-it style: the message content is trimmed.
TRIM = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINK = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think></think>"
         "{% endif %}")


@pytest.fixture(scope="module")
def trim_tok():
    tok = tiny_tokenizer()
    tok.chat_template = TRIM
    return tok


def test_trimming_template_boundary(trim_tok):
    context, question = "  The grass is green. The sky is blue.  ", "What is blue?  "
    text, cut = render_chat(trim_tok, context, question, answer_prefix=" Answer:")
    assert text == "<|im_start|>user\nThe grass is green. The sky is blue.  What is blue?<|im_end|>\n" \
                   "<|im_start|>assistant\n Answer:"
    assert text[:cut].endswith("The sky is blue.  ") and text[cut:].startswith("What is blue?")


@pytest.mark.parametrize("context, question, before, after", [
    ("   ", "What?", "<|im_start|>user\n", "What?<|im_end|>"),      # all-whitespace context: trimmed away
    ("Context. ", "  ", "<|im_start|>user\nContext.", "<|im_end|>"),  # all-whitespace question
    ("Context.", "", "<|im_start|>user\nContext.", "<|im_end|>"),
])
def test_trimmed_edges(trim_tok, context, question, before, after):
    text, cut = render_chat(trim_tok, context, question)
    assert text[:cut] == before and text[cut:].startswith(after)


def test_render_ids_split_under_a_trimming_template(trim_tok):
    s = Sample(id="s", task="t", context="The grass is green. The sky is blue. ", question="What is blue? ",
               answers=("sky",), max_new_tokens=4, metric="string_match_all", answer_prefix=" Answer:")
    ctx, q = render_ids(trim_tok, s)
    text, _ = render_text(trim_tok, s)
    assert ctx + q == trim_tok(text, add_special_tokens=False)["input_ids"]
    assert trim_tok.decode(ctx).endswith("The sky is blue. ")
    assert trim_tok.decode(q).startswith("What is blue?")


def test_plain_text_and_template_kwargs():
    tok = tiny_tokenizer(chat=False)
    assert render_chat(tok, "ctx ", "q?", answer_prefix=" A:") == ("ctx q? A:", 4)
    tok = tiny_tokenizer()
    tok.chat_template = THINK
    on, _ = render_chat(tok, "ctx ", "q?")
    off, cut = render_chat(tok, "ctx ", "q?", template_kwargs={"enable_thinking": False})
    assert off == on + "<think></think>" and off[:cut].endswith("ctx ")
