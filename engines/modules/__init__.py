"""Building blocks shared by the LM and the Mimi codec (all batched over session slots)."""
