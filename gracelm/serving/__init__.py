"""What a route does with a request once it is read: the OpenAI protocol's types, the checks of its fields,
the prompt, the call to the engine and the answer, whole or streamed (SSE); the errors as OpenAI's JSON."""
