"""DeepSeek-V4 layers (torch), written for flattened serving batches."""
