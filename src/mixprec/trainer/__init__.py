"""mixprec.trainer"""
