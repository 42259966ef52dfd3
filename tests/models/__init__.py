"""Tiny MoE models shared by pass, backend and model tests (HF families and hand-written layers)."""
