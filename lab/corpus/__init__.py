"""Corpus makers: HTML books to prose (``html_to_prose``), manual pages to text (``man_to_text``)."""
