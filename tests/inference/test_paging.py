"""Page arithmetic of the paged cache: shifts and masks for power-of-two page sizes, integer
division otherwise, both equal to Python's divmod."""
import pytest
import torch

from dmc.inference.paging import at_page_boundary, page_and_offset, pages_for


@pytest.mark.parametrize("page", [1, 3, 4, 16, 24])
def test_page_arithmetic_equals_python_divmod(page):
    slots = torch.arange(0, 200, dtype=torch.int32)
    column, offset = page_and_offset(slots, page)
    assert column.tolist() == [n // page for n in range(200)]
    assert offset.tolist() == [n % page for n in range(200)]
    assert pages_for(slots, page).tolist() == [-(-n // page) for n in range(200)]
    assert at_page_boundary(slots, page).tolist() == [n % page == 0 for n in range(200)]
