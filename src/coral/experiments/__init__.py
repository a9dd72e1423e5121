"""The paper's studies as code: experiments, their reports and plots."""
