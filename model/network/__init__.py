"""The network: its config, the Transformer (encoder, decoder, attention, masks), the tokenizer,
the precisions it runs in. Pure torch modules: no kernels, no files, no CPU flags."""
