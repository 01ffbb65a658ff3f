"""Text in, text out: chat-template rendering (`prompt`) and `answer` (context + question -> an answer)."""

from vdjax.text.answer import Answer, answer

__all__ = ["Answer", "answer"]
