"""What the agent API adds to chat completions: Hy3's markup as a tokenizer spells it (`markup`), the
split of reasoning from content (`reasoning`) and tool calls parsed out of the text (`tool_calls`),
each whole and streamed."""
