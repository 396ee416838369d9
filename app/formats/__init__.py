"""Text formats: sentence segmentation, inline markup, HTML, .docx runs, OpenDocument, .pptx, .epub,
.pdf and the documents of /translate_file. No I/O: bytes or strings in, the same structure out."""
