"""Model artifacts: the catalog (``models.yaml``), file formats, and downloads through huggingface_hub."""
