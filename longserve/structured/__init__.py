"""Structured output and tool calling: GrammarSpec (spec.py), xgrammar compile/match/mask (grammar.py),
request dialects (request_formats.py), tool-call parsing (tool_calls.py, tool_parsers.py over json_scan.py;
the XML syntax's typed values in qwen_xml.py) and forcing grammars (tool_grammar.py), reasoning sections
(reasoning.py). Only grammar.py needs xgrammar, imported on use; nothing here touches CUDA at import."""
