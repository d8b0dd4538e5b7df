"""Pure compute of the Moshi/PersonaPlex model: the LM, its layers, sampling, the prompt pass, Mimi."""
