"""Reporting: metrics, figures, the Markdown/HTML renderers and timeline traces."""
