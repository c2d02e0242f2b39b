"""Built-in engines (the top-level engines/ folder), importable as octo.engines.*"""
