"""A checkpoint read, checked and written in its canonical form: formats, config, tokenizer, convert."""
