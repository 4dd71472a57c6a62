"""(issue 13: being written)"""
