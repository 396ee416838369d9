"""Text formats: sentence segmentation, inline markup, HTML, .docx runs and documents. No I/O:
bytes or strings in, the same structure out."""
